"""Streamed chat completions: Server-Sent Events in OpenAI's `chat.completion.chunk` format.

What streams as it is generated: every sampled token, with its id and logprob, in a chunk sent right
after its decoding step (the torch sampler hands each step's tokens over; the vLLM sampler relays vLLM's
own stream), and the text those tokens decode to, except what has to wait for the end:
- an incomplete UTF-8 character (the next token completes it);
- text that may be the start of a stop string (the text stops before a stop string, as OpenAI's does);
- with `tools`: everything from `<tool_call>` on and whitespace at the end (the final content is parsed
  and stripped as a non-streamed one is), and all of it if it starts with whitespace.
Each choice's last chunk brings the held-back text, its tool calls and its finish_reason; then a usage
chunk (stream_options.include_usage), then `data: [DONE]`. Put together, a choice's chunks are the
non-streamed choice: artcloud.streaming.collect does that on the client.

    first chunk   prompt_token_ids; per choice: delta.role, prompt_sha256, temperature
    token chunks  one choice each: delta.content (text may lag its tokens), token_ids, logprobs.content
    last chunks   one choice each: the rest of delta.content, delta.tool_calls, finish_reason
    usage chunk   choices [], usage                                   (stream_options.include_usage)

A client that goes away stops its samples at the sampler's next step, or before they start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

from starlette.responses import StreamingResponse

from artcloud.server import chat
from artcloud.server.api_errors import ApiError
from artcloud.server.batching import Batcher
from artcloud.server.engines.base import Completion, GenerationRequest, TokenSink

log = logging.getLogger("artcloud.server")

_TOOL_CALL_OPEN = "<tool_call>"


class ChatStream(TokenSink):
    """One streamed request's tokens, handed from the sampler's thread to the event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self.cancelled = False

    def tokens(self, sample: int, token_ids: list[int], logprobs: list[float],
               top_logprobs: list[list[tuple[int, float]]] | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ("tokens", sample, token_ids, logprobs, top_logprobs))
        except RuntimeError:  # the loop is closed: the server is stopping, nobody listens
            self.cancelled = True

    def started(self, served_as: str) -> None:  # on the loop (Registry._run_batch)
        self.queue.put_nowait(("start", served_as))


class _Text:
    """One choice's text as its tokens come: what may be sent now (`add`), and the rest at the end."""

    def __init__(self, tokenizer: Any, special: set[int], stops: list[str], tools: bool):
        self.tokenizer = tokenizer
        self.special = special
        self.holds = stops + ([_TOOL_CALL_OPEN] if tools else [])
        self.tools = tools
        self.ids: list[int] = []
        # Incremental decoding: ids[start:done] decode to the end of `text`; only the tokens after them
        # (and those few before, for context) are decoded again at each step.
        self.start = self.done = 0
        self.text = ""
        self.sent = ""

    def add(self, token_ids: list[int]) -> str:
        self.ids += [t for t in token_ids if t not in self.special]  # as the samplers' text leaves them out
        before = self.tokenizer.decode(self.ids[self.start:self.done])
        now = self.tokenizer.decode(self.ids[self.start:])
        if len(now) > len(before) and now.startswith(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self.start, self.done = self.done, len(self.ids)
        sendable = self._sendable()
        if len(sendable) <= len(self.sent) or not sendable.startswith(self.sent):
            return ""
        delta, self.sent = sendable[len(self.sent):], sendable
        return delta

    def _sendable(self) -> str:
        text = self.text
        cut = len(text)
        for hold in self.holds:
            found = text.find(hold)
            if found != -1:
                cut = min(cut, found)
            for k in range(min(len(hold) - 1, len(text)), 0, -1):  # an end that may grow into `hold`
                if text.endswith(hold[:k]):
                    cut = min(cut, len(text) - k)
                    break
        text = text[:cut]
        if self.tools:
            # The final content is stripped only if it holds a valid call: leading whitespace waits for
            # the end (and with it everything after), trailing whitespace for what follows it.
            text = "" if text[:1].isspace() else text.rstrip()
        return text

    def rest(self, final: str | None) -> str:
        """What is left to send of the final content (the one a non-streamed choice would have)."""
        final = final or ""
        if final.startswith(self.sent):
            return final[len(self.sent):]
        # Not for byte-level BPE vocabularies: their decoding only ever appends.
        log.warning("a streamed choice's text (%r...) is not a prefix of its final text (%r...); the streamed "
                    "content differs from the non-streamed one", self.sent[:40], final[:40])
        return ""


class EventStream(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def stream_response(self, send: Any) -> None:
        # However sending ends (a client gone away cancels it, maybe mid-send, maybe before the first
        # chunk), the request's generation is stopped now, not whenever the generator is collected.
        try:
            await super().stream_response(send)
        finally:
            self.on_close()


async def stream(*, batcher: Batcher, key: Any, request: GenerationRequest, prompt_ids: list[int], tokenizer: Any,
                 want_logprobs: bool, want_token_ids: bool, parse_tools: bool, include_usage: bool) -> EventStream:
    """Start generating; answer once the request's turn has come (errors before then are plain HTTP errors:
    404 for a step gone, 503 for a sampler restarting), then stream its chunks."""
    sink = ChatStream()
    request.sink = sink
    task = asyncio.get_running_loop().create_task(batcher.submit(key, request))
    task.add_done_callback(lambda _: sink.queue.put_nowait(("done",)))
    first = await sink.queue.get()
    served = first[1] if first[0] == "start" else task.result()[1]  # "done" first: the error is raised here
    stream_id = "chatcmpl-" + uuid.uuid4().hex

    def stop() -> None:
        """The client went away (or the stream ended): stop generating for it."""
        if not task.done() and not sink.cancelled:
            sink.cancelled = True
            task.add_done_callback(lambda t: _log_stopped(stream_id, t, request.params.max_tokens))

    chunks = _chunks(sink, task, stop, stream_id, served, request, prompt_ids, tokenizer, want_logprobs=want_logprobs,
                     want_token_ids=want_token_ids, parse_tools=parse_tools, include_usage=include_usage)
    return EventStream(chunks, on_close=stop)


async def _chunks(sink: ChatStream, task: asyncio.Task, stop: Callable[[], None], stream_id: str, served: str,
                  request: GenerationRequest, prompt_ids: list[int], tokenizer: Any, *, want_logprobs: bool,
                  want_token_ids: bool, parse_tools: bool, include_usage: bool) -> AsyncIterator[str]:
    n, params = request.n, request.params
    special = set(tokenizer.all_special_ids)
    texts = [_Text(tokenizer, special, params.stop, parse_tools) for _ in range(n)]
    sent_ids: list[list[int]] = [[] for _ in range(n)]
    head: dict[str, Any] = {"id": stream_id, "object": "chat.completion.chunk", "created": int(time.time()),
                            "model": served}
    if include_usage:
        head["usage"] = None  # as OpenAI: every chunk has the key, the last one a value

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return "data: " + json.dumps({**head, "choices": choices, **extra}, separators=(",", ":")) + "\n\n"

    def token_choice(i: int, ids: list[int], lps: list[float], tops: list[Any] | None, delta: dict[str, Any],
                     finish_reason: str | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": i, "delta": delta, "finish_reason": finish_reason,
            "logprobs": chat.logprobs_content(tokenizer, ids, lps, tops) if want_logprobs and ids else None,
        }
        if want_token_ids and ids:
            choice["token_ids"] = ids
        sent_ids[i] += ids
        return choice

    def token_chunks(new: dict[int, tuple[list[int], list[float], list[Any] | None]]) -> list[str]:
        # On a worker thread (as the non-streamed answer): the text and logprobs decode token by token.
        out = []
        for i, (ids, lps, tops) in new.items():
            text = texts[i].add(ids)
            out.append(chunk([token_choice(i, ids, lps, tops, {"content": text} if text else {})]))
        return out

    try:
        prompt_hash = chat.prompt_sha256(prompt_ids)
        yield chunk([{"index": i, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None,
                      "prompt_sha256": prompt_hash, "temperature": params.temperature} for i in range(n)],
                    **({"prompt_token_ids": prompt_ids} if want_token_ids else {}))
        finished = False
        while not finished:
            # Whatever has queued up meanwhile goes out together: one chunk per choice.
            new: dict[int, tuple[list[int], list[float], list[Any] | None]] = {}
            item = await sink.queue.get()
            while True:
                if item[0] == "done":
                    finished = True
                elif item[0] == "tokens":
                    _, i, ids, lps, tops = item
                    have = new.setdefault(i, ([], [], [] if tops is not None else None))
                    have[0].extend(ids)
                    have[1].extend(lps)
                    if have[2] is not None and tops is not None:
                        have[2].extend(tops)
                if finished or sink.queue.empty():
                    break
                item = sink.queue.get_nowait()
            for line in await asyncio.to_thread(token_chunks, new):
                yield line
        if task.cancelled():  # the batcher stopped: the server is shutting down
            raise ApiError(503, "shutting_down", "the server stopped generating: it is shutting down")
        completions, _ = task.result()
        last = [(i, c, texts[i], sent_ids[i], parse_tools, token_choice) for i, c in enumerate(completions)]
        for line in await asyncio.to_thread(lambda: [chunk([_last_choice(*args)]) for args in last]):
            yield line
        if include_usage:
            done = sum(len(c.token_ids) for c in completions)
            yield chunk([], usage={"prompt_tokens": len(prompt_ids), "completion_tokens": done,
                                   "total_tokens": len(prompt_ids) + done})
        yield "data: [DONE]\n\n"
    except Exception as e:  # the 200 went out with the first chunk: the error is the stream's last event
        if not isinstance(e, ApiError):
            log.exception("internal error while streaming a chat completion")
            e = ApiError(500, "internal_error", f"internal server error ({type(e).__name__}); this is a bug in artcloud")
        yield "data: " + json.dumps(e.body()) + "\n\n"
    finally:  # no awaits here: this also runs while the response is being cancelled
        stop()


def _last_choice(i: int, c: Completion, text: _Text, sent: list[int], parse_tools: bool, token_choice: Any) -> dict[str, Any]:
    content, tool_calls, finish_reason = chat.final_message(c, parse_tools)
    delta: dict[str, Any] = {}
    rest = text.rest(content)
    if rest or (content == "" and not text.sent):  # an empty content is "", not None, as unstreamed
        delta["content"] = rest
    if tool_calls:
        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(tool_calls)]
    if c.token_ids[:len(sent)] != sent:
        log.error("a streamed choice's tokens are not a prefix of its completion's: a sampler bug")
    # A sampler that streams has sent every token already; one that does not sends them all here.
    missing = len(sent)
    return token_choice(i, c.token_ids[missing:], c.logprobs[missing:],
                        c.top_logprobs[missing:] if c.top_logprobs else None, delta, finish_reason)


def _log_stopped(stream_id: str, task: asyncio.Task, max_tokens: int) -> None:
    if task.cancelled():
        log.info("chat stream %s: the client went away before its generation started; not generated", stream_id)
        return
    if task.exception() is not None:
        log.info("chat stream %s: the client went away; its generation failed: %s", stream_id, task.exception())
        return
    completions, _ = task.result()
    longest = max((len(c.token_ids) for c in completions), default=0)
    log.info("chat stream %s: the client went away; generation stopped after %d tokens (max_tokens %d)",
             stream_id, longest, max_tokens)

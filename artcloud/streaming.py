"""Streamed chat completions, put back together into a completion whose choices can be trained on.

    stream = await client.chat.completions.create(model=model.name, messages=messages, stream=True)
    completion = await artcloud.collect_stream(stream)
    trajectory.messages_and_choices.append(completion.choices[0])

The result is what the same request without `stream` returns (an `openai` ChatCompletion whose choices
carry `token_ids`, `logprobs`, `prompt_sha256` and `temperature`), so a streamed choice trains exactly as
an unstreamed one. An agent framework that streams can hand its chunks to a `StreamCollector` one by one
as it reads them.

Why not openai's own `ChatCompletionStreamState` (behind `client.chat.completions.stream(...)
.get_final_completion()`): it keeps a choice's extra fields from its first chunk only, so the token ids
of every later chunk are lost (training then refuses the choice: its logprobs outnumber its token ids),
and it raises LengthFinishReasonError for a choice cut off at max_tokens, as rollouts often are. Its
events can be given to `collect_stream` all the same: their chunks are read from them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterable, Iterable

from artcloud.errors import ArtcloudError, WrongType

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletion

_CHOICE_KEYS = ("index", "delta", "logprobs", "finish_reason", "token_ids")


class StreamCollector:
    """Chunks in (`add`), the completion they make out (`completion`)."""

    def __init__(self) -> None:
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.chunks = 0

    def add(self, chunk: Any) -> None:
        """One `chat.completion.chunk`: an openai ChatCompletionChunk, its dict, or an event of
        `client.chat.completions.stream(...)` (only its "chunk" events count)."""
        if getattr(chunk, "type", None) == "chunk" and hasattr(chunk, "chunk"):
            chunk = chunk.chunk
        elif hasattr(chunk, "type") and not hasattr(chunk, "choices"):
            return  # openai's other stream events repeat what its chunk events hold
        if not isinstance(chunk, dict) and not hasattr(chunk, "model_dump"):
            raise WrongType(f"a chat completion chunk is an openai ChatCompletionChunk or a dict, not a "
                            f"{type(chunk).__name__}")
        data = chunk if isinstance(chunk, dict) else chunk.model_dump(mode="json")
        if data.get("error"):
            error = data["error"]
            raise ArtcloudError(f"the stream ended with an error: {error.get('message', error)}",
                                code=error.get("code") or "stream_error", field=error.get("field"))
        self.chunks += 1
        for key, value in data.items():
            if key == "usage" and value is not None:  # the last chunk's usage counts the whole completion
                self.head["usage"] = value
            elif key not in ("choices", "object", "usage") and value is not None:
                self.head.setdefault(key, value)
        for choice in data.get("choices") or []:
            self._add_choice(choice)

    def _add_choice(self, part: dict[str, Any]) -> None:
        i = part.get("index", 0)
        choice = self.choices.setdefault(i, {"index": i, "message": {"role": "assistant"}, "finish_reason": None,
                                             "logprobs": None, "tool_calls": {}})
        message = choice["message"]
        delta = part.get("delta") or {}
        if delta.get("role"):
            message["role"] = delta["role"]
        for key in ("content", "refusal"):
            if delta.get(key) is not None:
                message[key] = message.get(key, "") + delta[key]
        for call in delta.get("tool_calls") or []:
            have = choice["tool_calls"].setdefault(call.get("index", 0), {"function": {"name": "", "arguments": ""}})
            for key in ("id", "type"):
                if call.get(key):
                    have[key] = call[key]
            fn = call.get("function") or {}
            for key in ("name", "arguments"):
                if fn.get(key):
                    have["function"][key] += fn[key]
        logprobs = part.get("logprobs")
        if logprobs:
            have = choice["logprobs"] = choice["logprobs"] or {}
            for key in ("content", "refusal"):
                if logprobs.get(key) is not None:
                    have[key] = (have.get(key) or []) + list(logprobs[key])
        if part.get("token_ids") is not None:
            choice["token_ids"] = choice.get("token_ids", []) + list(part["token_ids"])
        if part.get("finish_reason"):
            choice["finish_reason"] = part["finish_reason"]
        for key, value in part.items():  # artcloud's prompt_sha256 and temperature, and whatever else
            if key not in _CHOICE_KEYS and value is not None:
                choice.setdefault(key, value)

    def completion(self) -> "ChatCompletion":
        """The completion so far (call it after the last chunk): an `openai` ChatCompletion, built as the
        client builds an unstreamed one, extra fields kept."""
        from openai.types.chat import ChatCompletion

        if not self.chunks:
            raise ArtcloudError("the stream had no chunks: nothing to collect", code="empty_stream")
        choices = []
        for i in sorted(self.choices):
            choice = dict(self.choices[i])
            calls = choice.pop("tool_calls")
            message = dict(choice["message"])
            message.setdefault("content", None)
            if calls:
                message["tool_calls"] = [{"type": "function", **calls[k]} for k in sorted(calls)]
            choice["message"] = message
            choices.append(choice)
        return ChatCompletion.construct(**{**self.head, "object": "chat.completion", "choices": choices})


async def collect_stream(stream: AsyncIterable[Any] | Iterable[Any]) -> "ChatCompletion":
    """Read a chat completion stream to its end (`stream=True` of the openai client, sync or async, or
    the events of `client.chat.completions.stream(...)`); return the completion it makes, as unstreamed."""
    collector = StreamCollector()
    if hasattr(stream, "__aiter__"):
        async for chunk in stream:  # type: ignore[union-attr]
            collector.add(chunk)
    elif hasattr(stream, "__iter__"):
        for chunk in stream:  # type: ignore[union-attr]
            collector.add(chunk)
    else:
        raise WrongType("collect_stream takes a stream of chat completion chunks (stream=True), not a "
                        f"{type(stream).__name__}")
    return collector.completion()

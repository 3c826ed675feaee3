"""Chat messages <-> tokens: prompt rendering through the model's chat template, tool calls, responses.

The same `render_prompt` serves inference and training, so the context a trajectory is trained on is
token-for-token the context its turns were sampled from. Each choice carries `prompt_sha256` (of the
prompt it was sampled from) so that training can check this, turn by turn, instead of trusting it.

Tool calls use the Hermes format that Qwen2.5 and many open models speak:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A chat template that knows nothing of tools
(SmolLM2's, for one) gets the tool list in its system message and tool traffic as plain text, so tools
are never silently dropped.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import struct
import time
import uuid
from typing import Any

from artcloud.errors import InvalidArgument
from artcloud.server.engines.base import Completion

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

_TOOLS_SYSTEM = """\
You may call one or more functions. Function signatures are inside <tools></tools>:
<tools>
{tools}
</tools>
For each call, return a JSON object inside <tool_call></tool_call>:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # OpenAI content parts: keep the text ones.
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function", {})
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}) + "\n</tool_call>"


def template_knows_tools(tokenizer: Any) -> bool:
    template = tokenizer.chat_template or ""
    return "tools" in template and "tool_calls" in template


def normalise_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, knows_tools: bool
) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: plain string content, tools spelled out if needed."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"))}
        if knows_tools:
            if m.get("tool_calls"):
                msg["tool_calls"] = m["tool_calls"]
            if m.get("tool_call_id"):
                msg["tool_call_id"] = m["tool_call_id"]
        else:
            if m.get("tool_calls"):
                calls = "\n".join(_call_text(c) for c in m["tool_calls"])
                msg["content"] = (msg["content"] + "\n" + calls).strip()
            if role == "tool":
                msg = {"role": "user", "content": f"<tool_response>\n{msg['content']}\n</tool_response>"}
        out.append(msg)
    if tools and not knows_tools:
        listing = _TOOLS_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """Token ids of the conversation so far, ending where the assistant's next turn starts."""
    knows = template_knows_tools(tokenizer)
    kwargs: dict[str, Any] = {"tools": tools} if (tools and knows) else {}
    text = tokenizer.apply_chat_template(
        normalise_messages(messages, tools, knows), add_generation_prompt=True, tokenize=False, **kwargs
    )
    # The template already wrote any BOS token it wants.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_conversation(tokenizer: Any, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None) -> tuple[list[int], list[bool]]:
    """A whole conversation's token ids, and which of them are the assistant's (supervised fine-tuning trains on
    those: each assistant turn as the model would write it after render_prompt's context, its end-of-turn token
    included). InvalidArgument for a chat template that renders an earlier turn differently once later ones follow."""
    knows = template_knows_tools(tokenizer)
    kwargs: dict[str, Any] = {"tools": tools} if (tools and knows) else {}
    norm = normalise_messages(messages, tools, knows)

    def render(upto: int, prompt: bool) -> str:
        return tokenizer.apply_chat_template(norm[:upto], add_generation_prompt=prompt, tokenize=False, **kwargs)

    full = render(len(norm), False)
    spans = []  # the characters of each assistant turn in `full`
    for i, m in enumerate(norm):
        if m["role"] != "assistant":
            continue
        before, through = render(i, True), render(i + 1, False)
        if not (full.startswith(through) and through.startswith(before)):
            raise InvalidArgument("this chat template renders an assistant turn differently once later messages follow it "
                             "(it may drop earlier turns' reasoning): give each assistant turn a row of its own")
        spans.append((len(before), len(through)))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)  # the template wrote any BOS
    trained = [any(a < end and start < b for a, b in spans) for start, end in encoded["offset_mapping"]]
    return encoded["input_ids"], trained


def prompt_sha256(prompt_ids: list[int]) -> str:
    """sha256 hex digest of token ids, each written as 4 bytes, unsigned little-endian (vocabularies are
    far below 2**32). Both sides use this one function: the chat route stamps it on each choice, the
    training route compares it with the hash of the re-rendered context."""
    return hashlib.sha256(struct.pack(f"<{len(prompt_ids)}I", *prompt_ids)).hexdigest()


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content without the tool-call blocks, OpenAI tool_calls) from a completion's text."""
    calls = []
    for raw in _TOOL_CALL.findall(text):
        if not _is_call(raw):
            continue  # not a valid call: leave it in the content for the caller to see
        obj = json.loads(raw)
        name = obj["name"]
        args = obj.get("arguments", {})
        calls.append({
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
        })
    if not calls:
        return text, []
    content = _TOOL_CALL.sub(lambda m: "" if _is_call(m.group(1)) else m.group(0), text).strip()
    return content or None, calls


def _is_call(raw: str) -> bool:
    try:
        obj = json.loads(raw)
    except ValueError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("name"), str) and bool(obj["name"])


def completion_response(
    *,
    served_as: str,
    prompt_ids: list[int],
    completions: list[Completion],
    tokenizer: Any,
    want_logprobs: bool,
    want_token_ids: bool,
    parse_tools: bool,
) -> dict[str, Any]:
    """An OpenAI `chat.completion` object, plus vLLM-style `prompt_token_ids` and per-choice `token_ids`.

    Each choice also carries what training needs to check it is trained on what was sampled:
    `prompt_sha256` (see `prompt_sha256`) and `temperature` (the one it was sampled at, 0 = greedy;
    its logprobs are of that distribution).
    """
    prompt_hash = prompt_sha256(prompt_ids)
    choices = []
    for i, c in enumerate(completions):
        content, tool_calls, finish_reason = final_message(c, parse_tools)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice: dict[str, Any] = {
            "index": i,
            "message": message,
            "finish_reason": finish_reason,
            "logprobs": logprobs_content(tokenizer, c.token_ids, c.logprobs, c.top_logprobs) if want_logprobs else None,
            "prompt_sha256": prompt_hash,
            "temperature": c.temperature,
        }
        if want_token_ids:
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    completion_tokens = sum(len(c.token_ids) for c in completions)
    body: dict[str, Any] = {
        "id": "chatcmpl-" + uuid.uuid4().hex,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served_as,
        "choices": choices,
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                  "total_tokens": len(prompt_ids) + completion_tokens},
    }
    if want_token_ids:
        body["prompt_token_ids"] = prompt_ids
    return body


def final_message(c: Completion, parse_tools: bool) -> tuple[str | None, list[dict[str, Any]], str]:
    """(content, tool_calls, finish_reason) of a finished completion, streamed or not."""
    content: str | None = c.text
    tool_calls: list[dict[str, Any]] = []
    if parse_tools:
        content, tool_calls = parse_tool_calls(c.text)
    return content, tool_calls, "tool_calls" if tool_calls and c.finish_reason == "stop" else c.finish_reason


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte <-> printable-character map, inverted (what byte-level BPE vocabularies are written in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def token_bytes(tokenizer: Any, token_id: int) -> list[int]:
    """The raw bytes of one token, as OpenAI's `bytes` field wants them: a token may be part of a
    multi-byte character, which `decode` alone would turn into U+FFFD."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    table = _byte_level_table()
    if piece and all(ch in table for ch in piece):
        return [table[ch] for ch in piece]
    m = _BYTE_FALLBACK.match(piece or "")
    if m:  # SentencePiece byte fallback
        return [int(m.group(1), 16)]
    return list(tokenizer.decode([token_id]).encode("utf-8"))


def _token_entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": tokenizer.decode([token_id]), "logprob": logprob, "bytes": token_bytes(tokenizer, token_id)}


def logprobs_content(tokenizer: Any, token_ids: list[int], logprobs: list[float],
                     top_logprobs: list[list[tuple[int, float]]] | None) -> dict[str, Any]:
    """OpenAI's `logprobs` of a choice (or of a streamed chunk's tokens)."""
    content = []
    for k, (tid, lp) in enumerate(zip(token_ids, logprobs)):
        entry = _token_entry(tokenizer, tid, lp)
        entry["top_logprobs"] = [_token_entry(tokenizer, t, v) for t, v in top_logprobs[k]] if top_logprobs else []
        content.append(entry)
    return {"content": content}

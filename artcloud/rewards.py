"""RULER: rewards from an LLM judge that ranks a group's trajectories against each other.

    from artcloud.rewards import ruler_score_group
    groups = await gather_trajectory_groups(..., after_each=lambda g: ruler_score_group(
        g, "gpt-4.1-mini", swallow_exceptions=True))

The judge sees all trajectories of a group at once: the messages they share are sent once as context,
each trajectory's remainder under its id, the tools listed once. It answers, per trajectory, a score in
[0, 1] and a short explanation, as JSON (`response_format` with a JSON schema where the endpoint takes
it; a tolerant parse of the text where not). Any OpenAI-compatible endpoint can judge: OpenAI,
OpenRouter, a vLLM server, or an artcloud server (so a judge can run offline).

Client SDK layer: openai, tenacity and pydantic only; `openai` is imported when a judge is first called.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from artcloud.errors import ArtcloudError, InvalidArgument, WrongState, WrongType
from artcloud.types import TrajectoryGroup

if TYPE_CHECKING:
    import openai

log = logging.getLogger("artcloud.rewards")

__all__ = ["DEFAULT_RUBRIC", "RulerError", "RulerScore", "RulerResponse", "ruler", "ruler_score_group"]

DEFAULT_RUBRIC = """\
You are comparing several attempts by an AI agent at the same task. Judge them against each other:
- An attempt that reaches the task's goal scores higher than one that does not, however polished the failed one is.
- Among attempts that reach the goal, prefer the one that does it more directly: fewer wasted steps,
  fewer needless tool calls, no padding.
- Follow the task's own instructions literally: format, length, language and constraints count.
- Attempts that stall, loop, invent facts or tool results, or ignore what a tool returned score low.
- Partial progress earns partial credit.
Use the whole range from 0 to 1 so that better attempts get clearly higher scores; equal work may get
equal scores.
"""

_OUTPUT_INSTRUCTIONS = """\

Reply with one JSON object and nothing else, in this form:
{"scores": [{"trajectory_id": "1", "explanation": "one or two sentences on why", "score": 0.7}, ...]}
Give exactly one entry for each trajectory id you were shown, each id once. Every score is a number from 0 to 1.
"""

# The JSON schema for `response_format` (strict: every object closed, every field required).
_SCORE_SCHEMA = {"type": "object", "required": ["trajectory_id", "explanation", "score"], "additionalProperties": False,
                 "properties": {"trajectory_id": {"type": "string"}, "explanation": {"type": "string"},
                                "score": {"type": "number"}}}
_SCHEMA = {"type": "object", "required": ["scores"], "additionalProperties": False,
           "properties": {"scores": {"type": "array", "items": _SCORE_SCHEMA}}}
_NO_USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "calls": 0}


class RulerError(ArtcloudError):
    """The judge gave no usable answer (after retries), or cannot be called at all."""

    code = "ruler_failed"


class _BadAnswer(ArtcloudError):
    """An answer that cannot be parsed or validated; worth asking again."""

    code = "judge_bad_answer"


class RulerScore(BaseModel):
    """The judge's verdict on one trajectory."""

    model_config = ConfigDict(extra="ignore", coerce_numbers_to_str=True)  # judges write ids as 1 or "1"

    trajectory_id: str
    explanation: str = ""
    score: float = Field(ge=0.0, le=1.0)


class RulerResponse(BaseModel):
    """The judge's whole answer: one score per trajectory id it was shown."""

    model_config = ConfigDict(extra="ignore")

    scores: list[RulerScore]


def _plain(item: Any) -> dict[str, Any]:
    """A message dict from a message dict, an OpenAI `Choice`, or a choice's dict."""
    if hasattr(item, "model_dump"):
        item = item.model_dump(mode="json", exclude_none=True)
    if not isinstance(item, dict):
        raise WrongType(f"a message must be a dict or an OpenAI Choice, not {type(item).__name__}")
    if "message" in item and "role" not in item:  # a Choice: the policy's own turn
        item = item["message"] or {}
    out: dict[str, Any] = {"role": item.get("role") or "assistant"}
    for key in ("name", "content", "tool_calls", "tool_call_id"):
        value = item.get(key)
        if value is None or value == []:
            continue
        if key == "tool_calls":
            value = [{"id": c.get("id"), "name": (c.get("function") or {}).get("name"),
                      "arguments": (c.get("function") or {}).get("arguments")} for c in value]
        out[key] = value
    return out


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _render_message(m: dict[str, Any]) -> str:
    content = m.get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        content = "\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    attrs = f' role="{m["role"]}"'
    if m.get("name"):
        attrs += f' name="{m["name"]}"'
    if m.get("tool_call_id"):
        attrs += f' tool_call_id="{m["tool_call_id"]}"'
    lines = [content] if content else []
    for call in m.get("tool_calls", []):
        lines.append(f"[tool call {call.get('id') or ''}] {call.get('name')}({call.get('arguments') or ''})")
    return f"<message{attrs}>\n" + "\n".join(lines) + "\n</message>"


def _common_prefix(lists: Sequence[Sequence[dict[str, Any]]]) -> int:
    n = min(len(x) for x in lists)
    for i in range(n):
        first = lists[0][i]
        if any(x[i] != first for x in lists[1:]):
            return i
    return n


def _judge_prompt(unique: list[list[dict[str, Any]]], tools: list[dict[str, Any]], rubric: str) -> list[dict[str, str]]:
    k = _common_prefix(unique) if len(unique) > 1 else max(0, len(unique[0]) - 1)
    parts = [f"Below are {len(unique)} trajectories (ids 1 to {len(unique)}) by an agent, which all start from the "
             "same context."]
    if k:
        parts.append("<context>\n" + "\n".join(_render_message(m) for m in unique[0][:k]) + "\n</context>")
    if tools:
        parts.append("<tools>\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + "\n</tools>")
    for i, messages in enumerate(unique, 1):
        rest = messages[k:]
        body = "\n".join(_render_message(m) for m in rest) if rest else "(nothing beyond the context)"
        parts.append(f'<trajectory id="{i}">\n{body}\n</trajectory>')
    parts.append("Score every trajectory by the rubric, as the JSON object described.")
    return [{"role": "system", "content": rubric.strip() + "\n" + _OUTPUT_INSTRUCTIONS},
            {"role": "user", "content": "\n\n".join(parts)}]


_FENCE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.S)
_THINK = re.compile(r"<think>.*?</think>", re.S)


def parse_answer(text: str | None, ids: list[str]) -> list[RulerScore]:
    """The judge's scores, in the order of `ids`; _BadAnswer unless every id is there exactly once."""
    if not text or not text.strip():
        raise _BadAnswer("the judge's answer is empty")
    text = _THINK.sub("", text)
    fenced = _FENCE.search(text)
    data: Any = None
    for candidate in ([fenced.group(1)] if fenced else []) + [text]:  # a ```json block first, then the whole text
        data = _json_in(candidate.strip())
        if data is not None:
            break
    if data is None:
        raise _BadAnswer(f"no JSON object in the judge's answer: {text[:200]!r}")
    if isinstance(data, list):
        data = {"scores": data}
    try:
        answer = RulerResponse.model_validate(data)
    except ValidationError as e:
        raise _BadAnswer(f"the judge's JSON does not fit the schema: {e.errors()[:3]}") from e
    got = [s.trajectory_id.strip() for s in answer.scores]
    if len(got) != len(ids) or sorted(got) != sorted(ids):
        raise _BadAnswer(f"the judge scored ids {got}; it was shown {ids}")
    by_id = {s.trajectory_id.strip(): s for s in answer.scores}
    return [by_id[i] for i in ids]


def _json_in(text: str) -> Any:
    """The text as JSON, else the first JSON object in it (from its first "{"); None if neither parses."""
    try:
        return json.loads(text)
    except ValueError:
        start = text.find("{")
    try:
        return json.JSONDecoder().raw_decode(text[start:])[0] if start >= 0 else None
    except ValueError:
        return None


# LiteLLM-style judge ids, as OpenPipe ART passes them ("openai/o4-mini", "openrouter/qwen/qwen3-32b"):
# the provider's OpenAI-compatible endpoint and the environment variable that holds its key.
JUDGE_PROVIDERS: dict[str, tuple[str | None, str]] = {
    "openai": (None, "OPENAI_API_KEY"),  # None: OpenAI itself (or OPENAI_BASE_URL)
    "openrouter": ("https://openrouter.ai/api/v1", "OPENROUTER_API_KEY"),
    "anthropic": ("https://api.anthropic.com/v1/", "ANTHROPIC_API_KEY"),
    "gemini": ("https://generativelanguage.googleapis.com/v1beta/openai/", "GEMINI_API_KEY"),
    "groq": ("https://api.groq.com/openai/v1", "GROQ_API_KEY"),
    "deepseek": ("https://api.deepseek.com/v1", "DEEPSEEK_API_KEY"),
    "xai": ("https://api.x.ai/v1", "XAI_API_KEY"),
    "mistral": ("https://api.mistral.ai/v1", "MISTRAL_API_KEY"),
    "together_ai": ("https://api.together.xyz/v1", "TOGETHERAI_API_KEY"),
    "fireworks_ai": ("https://api.fireworks.ai/inference/v1", "FIREWORKS_AI_API_KEY"),
}
# LiteLLM prefixes with no fixed OpenAI-compatible endpoint: they need base_url= (api_base) or client=.
_NEEDS_ENDPOINT = {"hosted_vllm", "azure", "azure_ai", "bedrock", "vertex_ai", "ollama", "ollama_chat", "cohere",
                   "huggingface", "sagemaker", "watsonx", "databricks", "replicate", "openai_compatible"}
# extra_litellm_params keys that name the endpoint or a sampling setting artcloud has by another name.
_LITELLM_ENDPOINT = {"api_base": "base_url", "base_url": "base_url", "api_key": "api_key"}
_LITELLM_SETTINGS = {"temperature", "max_tokens", "timeout"}


def resolve_judge(judge_model: str, *, client: Any, base_url: str | None, api_key: str | None,
                  extra_litellm_params: dict[str, Any] | None,
                  ) -> tuple[str, str | None, str | None, dict[str, Any], dict[str, Any]]:
    """(model id, base_url, api_key, settings, extra_body) for a judge named as artcloud does (a bare id at
    `base_url`/`client`, default OpenAI) or as ART does (a LiteLLM id, `extra_litellm_params`). Bare ids,
    and ids whose first part is not a LiteLLM provider ("Qwen/Qwen3-8B"), are sent unchanged."""
    settings: dict[str, Any] = {}
    extra_body: dict[str, Any] = {}
    for key, value in (extra_litellm_params or {}).items():
        if key in _LITELLM_ENDPOINT:
            given = {"base_url": base_url, "api_key": api_key}[_LITELLM_ENDPOINT[key]]
            if given is not None and given != value:
                raise InvalidArgument(f"extra_litellm_params[{key!r}] and {_LITELLM_ENDPOINT[key]}= disagree: pass one",
                                      field="extra_litellm_params")
            if _LITELLM_ENDPOINT[key] == "base_url":
                base_url = value
            else:
                api_key = value
        elif key in _LITELLM_SETTINGS:
            settings[key] = value
        else:
            extra_body[key] = value  # sent to the endpoint as is (e.g. reasoning_effort)
    provider, slash, rest = judge_model.partition("/")
    if not slash or not rest or (provider not in JUDGE_PROVIDERS and provider not in _NEEDS_ENDPOINT):
        return judge_model, base_url, api_key, settings, extra_body
    if client is not None or base_url is not None:  # LiteLLM's api_base: that endpoint, the id without its prefix
        return rest, base_url, api_key, settings, extra_body
    if provider in _NEEDS_ENDPOINT:
        raise InvalidArgument(f"judge_model {judge_model!r} is a LiteLLM id for {provider}, which has no fixed "
                              f"OpenAI-compatible endpoint: pass base_url= (its OpenAI-compatible URL) or client=, "
                              f"with judge_model={rest!r}", field="judge_model")
    url, env = JUDGE_PROVIDERS[provider]
    if api_key is None and url is not None:
        api_key = os.environ.get(env)
        if not api_key:
            raise InvalidArgument(f"judge_model {judge_model!r} needs {env} set (or api_key=)", field="judge_model")
    return rest, url, api_key, settings, extra_body


def _client(client: Any, base_url: str | None, api_key: str | None) -> "openai.AsyncOpenAI":
    import openai

    if client is not None:
        if base_url or api_key:
            raise InvalidArgument("pass either client or base_url/api_key, not both")
        return client.with_options(max_retries=0)  # tenacity owns the retries
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "none",
                              max_retries=0)


def _retryable(e: BaseException) -> bool:
    import openai

    if isinstance(e, (_BadAnswer, openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError)):
        return True  # APITimeoutError is an APIConnectionError
    return isinstance(e, openai.APIStatusError) and (e.status_code in (408, 409) or e.status_code >= 500)


async def _judge(
    unique: list[list[dict[str, Any]]], tools: list[dict[str, Any]], judge_model: str, *, rubric: str,
    client: Any, base_url: str | None, api_key: str | None, timeout: float, max_attempts: int,
    retry_wait_s: float, response_format: bool, max_tokens: int | None, temperature: float | None,
    extra_body: dict[str, Any] | None = None, debug: bool = False,
) -> tuple[list[RulerScore], dict[str, int]]:
    from tenacity import AsyncRetrying, RetryError, retry_if_exception, stop_after_attempt

    judge = _client(client, base_url, api_key)
    messages = _judge_prompt(unique, tools, rubric)
    ids = [str(i) for i in range(1, len(unique) + 1)]
    usage = dict(_NO_USAGE)
    state = {"response_format": response_format}
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "extra_body": extra_body or None}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}

    def wait(rs: Any) -> float:
        """Exponential backoff with jitter, or the endpoint's Retry-After where longer (at most a minute)."""
        base = min(retry_wait_s * 2 ** (rs.attempt_number - 1), 60.0) * (0.5 + random.random() / 2)
        try:
            return max(base, min(float(rs.outcome.exception().response.headers["retry-after"]), 60.0))
        except (AttributeError, KeyError, TypeError, ValueError):  # no HTTP answer, or no usable Retry-After
            return base

    async def once() -> list[RulerScore]:
        import openai

        if state["response_format"]:
            kwargs["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "ruler_scores", "schema": _SCHEMA, "strict": True}}
        else:
            kwargs.pop("response_format", None)
        try:
            response = await judge.chat.completions.create(model=judge_model, messages=messages, timeout=timeout,
                                                           **kwargs)
        except openai.BadRequestError as e:
            said = (str(e) + _canonical(getattr(e, "body", None) or "")).lower()
            if state["response_format"] and ("response_format" in said or "json_schema" in said):
                log.info("judge %s does not take response_format; asking for plain JSON instead", judge_model)
                state["response_format"] = False
                raise _BadAnswer(f"response_format refused: {e}") from e
            raise
        usage["calls"] += 1
        if response.usage is not None:
            usage["prompt_tokens"] += response.usage.prompt_tokens or 0
            usage["completion_tokens"] += response.usage.completion_tokens or 0
        if not response.choices:
            raise _BadAnswer("the judge returned no choices")
        if debug:
            from rich.console import Console

            Console(stderr=True).print(f"[RULER] {judge_model} answered:", response.choices[0].message.content,
                                       markup=False, highlight=False)
        return parse_answer(response.choices[0].message.content, ids)

    try:
        async for attempt in AsyncRetrying(stop=stop_after_attempt(max_attempts), wait=wait,
                                           retry=retry_if_exception(_retryable), reraise=False):
            with attempt:
                scores = await once()
    except RetryError as e:
        last = e.last_attempt.exception()
        raise RulerError(f"the judge {judge_model!r} gave no usable answer in {max_attempts} attempts; "
                         f"the last: {type(last).__name__}: {last}") from last
    except Exception as e:
        raise RulerError(f"the judge {judge_model!r} cannot be called: {type(e).__name__}: {e}") from e
    return scores, usage


def _cache_read(path: Path, n: int) -> list[RulerScore] | None:
    try:
        scores = [RulerScore.model_validate(s) for s in json.loads(path.read_text())["scores"]]
    except (OSError, ValueError, KeyError, TypeError, ValidationError):
        return None
    return scores if len(scores) == n else None


def _cache_write(path: Path, scores: list[RulerScore]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".ruler-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"scores": [s.model_dump() for s in scores]}, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


async def _score(
    message_lists: Iterable[Sequence[Any]], judge_model: str, tools: Iterable[dict[str, Any]] | None, *,
    rubric: str, client: Any, base_url: str | None, api_key: str | None, cache_dir: str | os.PathLike | None,
    timeout: float | None, max_attempts: int, retry_wait_s: float, response_format: bool,
    max_tokens: int | None, temperature: float | None, extra_litellm_params: dict[str, Any] | None = None,
    debug: bool = False,
) -> tuple[list[RulerScore], dict[str, int]]:
    judge_model, base_url, api_key, settings, extra_body = resolve_judge(
        judge_model, client=client, base_url=base_url, api_key=api_key, extra_litellm_params=extra_litellm_params)
    timeout = timeout if timeout is not None else settings.get("timeout", 120.0)
    max_tokens = max_tokens if max_tokens is not None else settings.get("max_tokens")
    temperature = temperature if temperature is not None else settings.get("temperature")
    plain = [[_plain(m) for m in messages] for messages in message_lists]
    if not plain:
        return [], {**_NO_USAGE, "cache_hits": 0}
    if any(not p for p in plain):
        raise InvalidArgument("every trajectory needs at least one message")
    # Identical trajectories are judged once, and get the same score; identical tools are listed once.
    keys = [_canonical(p) for p in plain]
    by_key = dict(zip(keys, plain))  # in the order first seen
    unique, index = list(by_key.values()), {k: i for i, k in enumerate(by_key)}
    which = [index[k] for k in keys]
    tool_list = list({_canonical(t): t for t in tools or []}.values())

    path = None
    if cache_dir is not None:  # keyed by everything the answer depends on
        key = _canonical({"judge": judge_model, "rubric": rubric, "trajectories": unique, "tools": tool_list})
        path = Path(cache_dir) / f"ruler-{hashlib.sha256(key.encode()).hexdigest()}.json"
    cached = _cache_read(path, len(unique)) if path is not None else None
    if cached is not None:
        scores, usage = cached, {**_NO_USAGE, "cache_hits": 1}
    else:
        scores, usage = await _judge(unique, tool_list, judge_model, rubric=rubric, client=client, base_url=base_url,
                                     api_key=api_key, timeout=timeout, max_attempts=max_attempts,
                                     retry_wait_s=retry_wait_s, response_format=response_format, max_tokens=max_tokens,
                                     temperature=temperature, extra_body=extra_body, debug=debug)
        usage["cache_hits"] = 0
        if path is not None:
            _cache_write(path, scores)
    return [scores[i] for i in which], usage


async def ruler(
    message_lists: Iterable[Sequence[Any]],
    judge_model: str = "openai/o3",
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    *,
    debug: bool = False,
    tools: Iterable[dict[str, Any]] | None = None,
    client: Any = None,
    base_url: str | None = None,
    api_key: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    timeout: float | None = None,
    max_attempts: int = 4,
    retry_wait_s: float = 1.0,
    response_format: bool = True,
    max_tokens: int | None = None,
    temperature: float | None = None,
) -> list[RulerScore]:
    """Judge trajectories (lists of message dicts or OpenAI Choices) against each other: one
    `RulerScore` (score in [0, 1], explanation) per list, in order.

    The judge is `client` (any `openai.AsyncOpenAI`), or one built from `base_url`/`api_key` (default:
    OpenAI, with OPENAI_API_KEY). `judge_model` may be a bare id or, as in ART, a LiteLLM id
    ("openai/o4-mini", "openrouter/qwen/qwen3-32b", "anthropic/...", "gemini/...": see JUDGE_PROVIDERS), and
    `extra_litellm_params` ART's (api_base, api_key, temperature, max_tokens, timeout; other keys go to the
    endpoint as extra body fields). `debug` prints the judge's raw answer. Rate limits, 5xx, timeouts and
    unparsable answers are retried (`max_attempts`, backoff from `retry_wait_s`, honouring Retry-After);
    then RulerError.
    `cache_dir` keeps each answer on disk, keyed by judge, rubric, tools and trajectories.
    """
    scores, _ = await _score(message_lists, judge_model, tools, rubric=rubric, client=client, base_url=base_url,
                             api_key=api_key, cache_dir=cache_dir, timeout=timeout, max_attempts=max_attempts,
                             retry_wait_s=retry_wait_s, response_format=response_format, max_tokens=max_tokens,
                             temperature=temperature, extra_litellm_params=extra_litellm_params, debug=debug)
    return scores


async def ruler_score_group(
    group: TrajectoryGroup,
    judge_model: str = "openai/o3",
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    *,
    debug: bool = False,
    client: Any = None,
    base_url: str | None = None,
    api_key: str | None = None,
    swallow_exceptions: bool = False,
    cache_dir: str | os.PathLike | None = None,
    price: tuple[float, float] | None = None,
    timeout: float | None = None,
    max_attempts: int = 4,
    retry_wait_s: float = 1.0,
    response_format: bool = True,
    max_tokens: int | None = None,
    temperature: float | None = None,
) -> TrajectoryGroup | None:
    """A copy of `group` with each trajectory's reward set to the judge's score.

    Each trajectory keeps its earlier reward as `metrics["independent_reward"]` and gets the judge's
    explanation in its `logs`; the group's `metrics` get the judge's tokens (`ruler_prompt_tokens`,
    `ruler_completion_tokens`, `ruler_calls`, `ruler_cache_hits`) and, with `price=(USD per million
    prompt tokens, USD per million completion tokens)`, `ruler_cost_usd`. When the judge fails, this
    raises RulerError, or with `swallow_exceptions=True` logs a warning and returns None (which drops
    the group in `gather_trajectory_groups(after_each=...)`). The other options are `ruler`'s.
    """
    # A judge that cannot be named is a mistake in the script, not a failed call: never swallowed.
    resolve_judge(judge_model, client=client, base_url=base_url, api_key=api_key,
                  extra_litellm_params=extra_litellm_params)
    try:
        if group.pending:
            raise WrongState("this group still has rollouts to run: use gather_trajectory_groups or await "
                             "group.resolve()")
        if not group.trajectories:
            return group
        tools = [t for traj in group.trajectories for t in (traj.tools or [])]
        scores, usage = await _score(
            [t.messages_and_choices for t in group.trajectories], judge_model, tools, rubric=rubric, client=client,
            base_url=base_url, api_key=api_key, cache_dir=cache_dir, timeout=timeout, max_attempts=max_attempts,
            retry_wait_s=retry_wait_s, response_format=response_format, max_tokens=max_tokens, temperature=temperature,
            extra_litellm_params=extra_litellm_params, debug=debug)
    except Exception as e:
        if not swallow_exceptions:
            raise
        log.warning("RULER dropped a group of %d: %s: %s", len(group.trajectories), type(e).__name__, e)
        return None

    out = group.model_copy(deep=True)
    for traj, s in zip(out.trajectories, scores):
        traj.metrics["independent_reward"] = traj.reward
        traj.metrics["ruler_score"] = s.score
        traj.reward = s.score
        traj.logs.append(f"RULER ({judge_model}) score {s.score:.3f}: {s.explanation}")
    metrics = out.metrics
    for key, value in usage.items():  # prompt_tokens, completion_tokens, calls, cache_hits
        metrics[f"ruler_{key}"] = metrics.get(f"ruler_{key}", 0) + value
    if price is not None:
        cost = (usage["prompt_tokens"] * price[0] + usage["completion_tokens"] * price[1]) / 1e6
        metrics["ruler_cost_usd"] = metrics.get("ruler_cost_usd", 0.0) + cost
    return out

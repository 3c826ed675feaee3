"""RULER: an LLM judge's relative scores as rewards, against a real HTTP server on loopback that speaks
the OpenAI chat-completions protocol with scripted answers, and once against an artcloud server."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message import ChatCompletionMessage

from artcloud.gather import gather_trajectory_groups
from artcloud.rewards import DEFAULT_RUBRIC, RulerError, ruler, ruler_score_group
from artcloud.types import Trajectory, TrajectoryGroup

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
PREFIX = [{"role": "system", "content": "SYSTEM_PROMPT_MARKER: be concise."},
          {"role": "user", "content": "Describe the sea in exactly five words."}]


def answer(scores: list[tuple[str, float]], explanation: str = "because") -> str:
    return json.dumps({"scores": [{"trajectory_id": i, "explanation": f"{explanation} {i}", "score": s} for i, s in scores]})


class Judge:
    """A scripted OpenAI chat-completions endpoint on 127.0.0.1. Each call takes the next action:
    a str (the answer's content), ("status", code, headers, body), ("sleep", seconds, content)."""

    def __init__(self, script: list[Any]):
        self.script = list(script)
        self.requests: list[dict[str, Any]] = []
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                judge.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
                action = judge.script.pop(0) if judge.script else ("status", 500, {}, {"error": {"message": "script ran out"}})
                if isinstance(action, tuple) and action[0] == "status":
                    _, code, headers, payload = action
                    return self._send(code, payload, headers)
                if isinstance(action, tuple) and action[0] == "sleep":
                    time.sleep(action[1])
                    action = action[2]
                if callable(action):  # an answer made from the request (e.g. one score per id it names)
                    action = action(body)
                self._send(200, {
                    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": action}}],
                    "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
                })

            def _send(self, code: int, payload: Any, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def user_prompt(self, i: int = -1) -> str:
        return self.requests[i]["body"]["messages"][1]["content"]




def choice(text: str) -> Choice:
    return Choice(index=0, finish_reason="stop", message=ChatCompletionMessage(role="assistant", content=text))


def group(*answers: str, rewards: list[float] | None = None, tools: Any = None) -> TrajectoryGroup:
    rewards = rewards or [0.0] * len(answers)
    return TrajectoryGroup([Trajectory(messages_and_choices=[*PREFIX, choice(a)], reward=r, tools=tools)
                            for a, r in zip(answers, rewards)])


FAST = {"api_key": "k", "retry_wait_s": 0.01, "timeout": 5.0}


def test_valid_answer_becomes_rewards_with_explanations_and_cost(judge):
    j = judge(answer([("1", 0.9), ("2", 0.2), ("3", 0.5)]))
    g = group("Vast blue water, endless waves.", "The sea.", "Salty, deep, wide, calm, blue, old.",
              rewards=[1.0, 0.2, 0.8], tools=TOOLS)
    out = asyncio.run(ruler_score_group(g, "judge-model", base_url=j.base_url, price=(2.0, 8.0), **FAST))

    assert [t.reward for t in out.trajectories] == [0.9, 0.2, 0.5]
    assert [t.metrics["independent_reward"] for t in out.trajectories] == [1.0, 0.2, 0.8]
    assert "because 2" in out.trajectories[1].logs[-1] and "judge-model" in out.trajectories[1].logs[-1]
    assert [t.reward for t in g.trajectories] == [1.0, 0.2, 0.8]  # the input group is left as it was
    assert out.metrics["ruler_prompt_tokens"] == 100 and out.metrics["ruler_completion_tokens"] == 20
    assert out.metrics["ruler_cost_usd"] == pytest.approx((100 * 2.0 + 20 * 8.0) / 1e6)
    assert out.to_wire()["trajectories"][0]["reward"] == 0.9  # the wire format carries the new reward only

    (req,) = j.requests
    body = req["body"]
    assert req["path"] == "/v1/chat/completions" and body["model"] == "judge-model" and req["auth"] == "Bearer k"
    assert body["response_format"]["type"] == "json_schema"
    assert DEFAULT_RUBRIC.strip() in body["messages"][0]["content"]
    prompt = j.user_prompt()
    assert prompt.count("SYSTEM_PROMPT_MARKER") == 1 and prompt.count("exactly five words") == 1  # shared prefix once
    assert prompt.count('"name": "lookup"') == 1  # tools listed once
    for i, text in enumerate(["Vast blue water", "The sea.", "Salty, deep"], 1):
        assert f'<trajectory id="{i}">' in prompt and text in prompt
    assert '<trajectory id="4">' not in prompt


def test_identical_trajectories_are_judged_once(judge):
    j = judge(answer([("1", 0.3), ("2", 0.7)]))
    g = group("same answer here", "a different answer", "same answer here")
    out = asyncio.run(ruler_score_group(g, "m", base_url=j.base_url, **FAST))
    assert [t.reward for t in out.trajectories] == [0.3, 0.7, 0.3]
    assert j.user_prompt().count("same answer here") == 1 and '<trajectory id="3">' not in j.user_prompt()


def test_ruler_takes_message_lists_and_custom_rubric(judge):
    j = judge("```json\n" + answer([("2", 0.25), ("1", 1)]) + "\n```")
    lists = [[*PREFIX, {"role": "assistant", "content": "one"}], [*PREFIX, {"role": "assistant", "content": "two"}]]
    scores = asyncio.run(ruler(lists, "m", rubric="RUBRIC_MARKER: prefer one.", base_url=j.base_url, **FAST))
    assert [s.score for s in scores] == [1.0, 0.25] and scores[1].explanation == "because 2"
    assert j.requests[0]["body"]["messages"][0]["content"].startswith("RUBRIC_MARKER")


@pytest.mark.parametrize("bad", [
    "I think the first one is best.",                         # malformed: no JSON at all
    '{"scores": [{"trajectory_id": "1", "score": 0.5',        # malformed: cut off
    answer([("1", 0.5)]),                                     # wrong count
    answer([("1", 0.5), ("7", 0.5)]),                         # wrong ids
    answer([("1", 0.5), ("1", 0.6)]),                         # an id twice
    answer([("1", 1.5), ("2", 0.5)]),                         # a score out of range
])
def test_bad_answers_are_asked_again(judge, bad):
    j = judge(bad, "Here you go: " + answer([("1", 0.1), ("2", 0.9)]) + " Hope it helps.")
    out = asyncio.run(ruler_score_group(group("a", "b"), "m", base_url=j.base_url, **FAST))
    assert [t.reward for t in out.trajectories] == [0.1, 0.9]
    assert len(j.requests) == 2 and out.metrics["ruler_calls"] == 2
    assert out.metrics["ruler_prompt_tokens"] == 200  # both calls' tokens are counted


def test_bad_answers_every_time_raise_or_drop_the_group(judge):
    j = judge(*["not json"] * 3)
    with pytest.raises(RulerError, match="3 attempts.*no JSON"):
        asyncio.run(ruler_score_group(group("a", "b"), "m", base_url=j.base_url, max_attempts=3, **FAST))
    j = judge(*[answer([("1", 0.5)])] * 2)
    assert asyncio.run(ruler_score_group(group("a", "b"), "m", base_url=j.base_url, max_attempts=2,
                                         swallow_exceptions=True, **FAST)) is None
    assert len(j.requests) == 2


@pytest.mark.parametrize("status", [429, 500, 503])
def test_rate_limits_and_server_errors_are_retried(judge, status):
    j = judge(("status", status, {"Retry-After": "0"}, {"error": {"message": "slow down"}}), answer([("1", 0.4), ("2", 0.6)]))
    t0 = time.monotonic()
    out = asyncio.run(ruler_score_group(group("a", "b"), "m", base_url=j.base_url, **FAST))
    assert [t.reward for t in out.trajectories] == [0.4, 0.6] and len(j.requests) == 2
    assert time.monotonic() - t0 < 3


def test_retry_after_is_honoured(judge):
    j = judge(("status", 429, {"Retry-After": "1"}, {"error": {"message": "slow down"}}), answer([("1", 0.4), ("2", 0.6)]))
    t0 = time.monotonic()
    asyncio.run(ruler_score_group(group("a", "b"), "m", base_url=j.base_url, **FAST))
    assert time.monotonic() - t0 >= 0.9


def test_a_timeout_is_retried(judge):
    j = judge(("sleep", 1.0, answer([("1", 0.0), ("2", 0.0)])), answer([("1", 0.3), ("2", 0.8)]))
    out = asyncio.run(ruler_score_group(group("a", "b"), "m", base_url=j.base_url, api_key="k", timeout=0.3, retry_wait_s=0.01))
    assert [t.reward for t in out.trajectories] == [0.3, 0.8] and len(j.requests) == 2


def test_timeouts_every_time_raise(judge):
    j = judge(*[("sleep", 1.0, "late")] * 2)
    with pytest.raises(RulerError, match="APITimeoutError"):
        asyncio.run(ruler_score_group(group("a", "b"), "m", base_url=j.base_url, api_key="k", timeout=0.2,
                                      retry_wait_s=0.01, max_attempts=2))


def test_client_errors_are_not_retried(judge):
    j = judge(("status", 401, {}, {"error": {"message": "bad key"}}))
    with pytest.raises(RulerError, match="cannot be called.*bad key"):
        asyncio.run(ruler_score_group(group("a", "b"), "m", base_url=j.base_url, **FAST))
    assert len(j.requests) == 1


def test_an_endpoint_without_response_format_gets_plain_json(judge):
    refusal = ("status", 400, {}, {"error": {"message": "response_format json_schema is not supported", "param": "response_format"}})
    j = judge(refusal, answer([("1", 0.2), ("2", 0.4)]))
    out = asyncio.run(ruler_score_group(group("a", "b"), "m", base_url=j.base_url, **FAST))
    assert [t.reward for t in out.trajectories] == [0.2, 0.4]
    assert "response_format" in j.requests[0]["body"] and "response_format" not in j.requests[1]["body"]
    j = judge(answer([("1", 0.2), ("2", 0.4)]))
    asyncio.run(ruler_score_group(group("a", "b"), "m", base_url=j.base_url, response_format=False, **FAST))
    assert "response_format" not in j.requests[0]["body"]


def test_the_cache_makes_rescoring_free(judge, tmp_path):
    j = judge(answer([("1", 0.2), ("2", 0.9)]), answer([("1", 0.5), ("2", 0.5)]))
    kw = dict(base_url=j.base_url, cache_dir=tmp_path, **FAST)
    first = asyncio.run(ruler_score_group(group("a", "b"), "m", **kw))
    again = asyncio.run(ruler_score_group(group("a", "b"), "m", **kw))
    assert [t.reward for t in again.trajectories] == [t.reward for t in first.trajectories] == [0.2, 0.9]
    assert len(j.requests) == 1 and again.metrics["ruler_cache_hits"] == 1 and again.metrics["ruler_prompt_tokens"] == 0
    # Another rubric (or judge, or trajectories) is another key.
    other = asyncio.run(ruler_score_group(group("a", "b"), "m", rubric="Be harsh.", **kw))
    assert [t.reward for t in other.trajectories] == [0.5, 0.5] and len(j.requests) == 2
    assert not list(tmp_path.glob(".ruler-*"))  # no temporary files left behind


def test_after_each_drops_the_groups_the_judge_fails_on(judge):
    j = judge(answer([("1", 1.0), ("2", 0.0)]), *["garbage"] * 2)

    async def rollout(text: str) -> Trajectory:
        await asyncio.sleep(0)
        return Trajectory(messages_and_choices=[*PREFIX, choice(text)], reward=0.5)

    async def main() -> list[TrajectoryGroup]:
        score = partial(ruler_score_group, judge_model="m", base_url=j.base_url, max_attempts=2,
                        swallow_exceptions=True, **FAST)
        first = await gather_trajectory_groups([TrajectoryGroup(rollout(t) for t in ("x", "y"))], after_each=score, progress=False)
        second = await gather_trajectory_groups([TrajectoryGroup(rollout(t) for t in ("p", "q"))], after_each=score, progress=False)
        return first + second

    groups = asyncio.run(main())
    assert len(groups) == 1 and [t.reward for t in groups[0].trajectories] == [1.0, 0.0]
    assert len(j.requests) == 3


def test_an_artcloud_server_can_be_the_judge(tiny_server):
    """The plumbing only: tiny-random's answers are noise, so the judge is asked `max_attempts` times,
    each answer reaches the parser, and the error says so (or the group is dropped)."""
    async def main() -> None:
        http = openai.DefaultAsyncHttpxClient(verify=tiny_server.ssl_context())
        async with openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key=tiny_server.token, http_client=http) as client:
            kw = dict(client=client, max_attempts=2, retry_wait_s=0.01, max_tokens=16, timeout=120.0)
            with pytest.raises(RulerError, match="2 attempts.*_BadAnswer") as e:
                await ruler_score_group(group("a", "b"), "agent", **kw)
            assert isinstance(e.value.__cause__, Exception) and not isinstance(e.value.__cause__, openai.APIError)
            assert await ruler_score_group(group("a", "b"), "agent", swallow_exceptions=True, **kw) is None

    asyncio.run(main())


@pytest.mark.slow
def test_the_ruler_example_trains_with_its_judge(judge, tmp_path):
    """examples/ruler_five_words.py end to end on tiny-random, with the scripted judge scoring every id it is shown."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    def score_every_id(body: dict[str, Any]) -> str:
        ids = re.findall(r'<trajectory id="(\d+)">', body["messages"][1]["content"])
        return answer([(i, (int(i) % 3) / 2) for i in ids])

    j = judge(*[score_every_id] * 8)
    example = Path(__file__).resolve().parents[1] / "examples" / "ruler_five_words.py"
    env = {**os.environ, "ARTCLOUD_JUDGE_BASE_URL": j.base_url, "ARTCLOUD_JUDGE_MODEL": "judge",
           "ARTCLOUD_JUDGE_API_KEY": "k"}
    result = subprocess.run([sys.executable, str(example), "--model", "artcloud/tiny-random", "--steps", "2",
                             "--prompts", "1", "--group", "3", "--max-tokens", "6"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert len(j.requests) >= 2 and all(r["body"]["model"] == "judge" for r in j.requests)

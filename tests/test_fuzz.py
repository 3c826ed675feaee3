"""Schemathesis against a live `artcloud serve`: the server is held to the OpenAPI schema it publishes.

A real server process (tiny-random) is fuzzed from its own /openapi.json, fetched with the token over
TLS with the server's own CA:

- every operation on its own, with valid (positive) and invalid (negative) requests;
- stateful sequences through the links the schema declares (register -> model info, temperature,
  train; train -> job, job events), so that the routes that take a name or a job id reach real models
  and real jobs, not only 404s.

No response may be a 5xx, and each must conform to the schema: a documented status code, its declared
content type, a body matching its schema. A request that takes over REQUEST_TIMEOUT_S is a hang, and
fails too. The cases are counted, and the test fails if fewer than MIN_CASES were sent, so that it
cannot pass by quietly sending nothing. Generation is seeded: CI sends the same requests as here.
"""

from __future__ import annotations

import json
import time
import zlib
from collections import Counter
from typing import Any

import pytest
import requests
import schemathesis
from conftest import TINY
from helpers import rollout_groups
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import FlakyStrategyDefinition, Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.config import OutputConfig, SanitizationConfig
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.slow

MIN_CASES = 2000
FUZZ_SEED = 14
# Per operation and generation mode; hypothesis stops earlier when an operation has fewer distinct
# requests (GET /health has one). More for the routes that reach the engine.
# A training case costs ~100 ms (its body's generation; half of them train a step), a stateful run of ~650 calls 15 s.
# Here: 2,004 stateless cases, then stateful runs until 600 calls and every link answered (2 runs, 1,318): 3,322 in
# 69 s alone on 2 cores, four to five times that beside the rest of `make test`.
STATELESS_EXAMPLES = {"chat_completions": 250, "train": 60}
STATELESS_DEFAULT = 60
# Stateful scenarios of up to STATEFUL_STEPS calls each, until STATEFUL_CASES calls were made.
STATEFUL_SCENARIOS = 80
STATEFUL_STEPS = 12
STATEFUL_CASES = 600
# A request that takes longer than this is a hang.
REQUEST_TIMEOUT_S = 60
# n x max_tokens of a chat request (artcloud serve --max-request-tokens). The fuzzer asks for up to
# n=128 completions, which the tiny model would take minutes to sample on a 2-core machine at the
# default budget; this is the server's own limit (a 400 above it), so it is fuzzed as well.
MAX_REQUEST_TOKENS = "64"
# The generated request bodies hold at most this many items per array. Hypothesis takes seconds per
# training request otherwise (groups of trajectories of messages of arbitrary JSON); this bounds only
# what the fuzzer generates, not what the server accepts.
MAX_ITEMS = 3

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]

# Operations left out, and why:
EXCLUDED = {
    # It pushes the final checkpoints and then makes the server exit: every later case would fail to
    # connect. tests/test_shutdown.py covers it. (Nothing else makes the server exit: it runs without
    # --lease and --max-duration here.)
    "shutdown",
    # An SFT job takes the model's training queue until its batches come (server/sft.py), and a fuzzer sends none:
    # every training job after it would wait its idle limit out. tests/test_sft.py drives it; its chunk route
    # (sft_batches) is fuzzed.
    "sft",
}

SETTINGS = dict(
    deadline=None,  # a request to a live server takes what it takes; REQUEST_TIMEOUT_S catches hangs
    database=None,
    suppress_health_check=list(HealthCheck),  # slow, large and filtered data generation is expected here
    # No shrinking: each shrink step is more requests to a server whose state has moved on. A failure
    # is reported with the request that failed (and a curl command to replay it).
    phases=[Phase.explicit, Phase.generate],
)


class Fuzzer:
    """Sends cases to the live server, checks each response, counts them, and keeps every failure (a
    failure seen once fails the test, even if hypothesis cannot replay it against the server's new
    state). Half of the valid cases, and every training request of a stateful walk, are steered to what exists on
    this server (the model `agent`, training groups it sampled), so that they get past the 404s into generation and
    training."""

    def __init__(self, url: str, token: str, ca: str, groups: list[dict[str, Any]]):
        self.groups = groups
        self.session = requests.Session()
        self.headers = {"Authorization": f"Bearer {token}"}
        self.kwargs = {"session": self.session, "headers": self.headers, "base_url": url, "verify": ca,
                       "timeout": REQUEST_TIMEOUT_S}
        self.cases = 0
        # (operation, status, error code) -> count
        self.statuses: Counter[tuple[str, int, str]] = Counter()
        self.failures: list[BaseException] = []
        self.jobs: set[str] = set()  # the training jobs the fuzzer started
        self.slowest: list[tuple[float, str, int]] = []

    def steer(self, case: schemathesis.Case, stateful: bool) -> None:
        meta = case.meta
        if meta is None or meta.generation.mode != GenerationMode.POSITIVE:
            return
        body = case.body if isinstance(case.body, dict) else {}
        # From the case itself, not a counter: a replayed case is steered the same way.
        digest = zlib.crc32(json.dumps([case.path_parameters, body], sort_keys=True, default=str).encode())
        op = case.operation.definition.raw["operationId"]
        if stateful and op == "train":  # every walk's train has groups that train: its job's links are followed
            case.body = {**body, "groups": self.groups}
            return
        if digest % 2:
            return
        if op == "chat_completions":
            # To a model that exists, without what is a 400 before generation (streaming, top_logprobs
            # without logprobs) and, for half of them, within --max-request-tokens.
            body = {**body, "model": ["agent", "agent@0", TINY][digest // 2 % 3], "stream": False}
            if body.get("top_logprobs"):
                body["logprobs"] = True
            if digest // 6 % 2:
                tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 8
                body |= {"n": min(body.get("n", 1), 8), "max_completion_tokens": min(tokens, 8)}
            case.body = body
        elif op == "train":
            if not stateful:
                case.path_parameters = {**case.path_parameters, "name": "agent"}
            case.body = {**body, "groups": self.groups}
        elif op in ("get_model_info", "set_temperature", "prune_checkpoints", "log_metrics") and not stateful:
            case.path_parameters = {**case.path_parameters, "name": "agent"}
        elif op == "register_model" and stateful:
            # A model on the base model this server holds, so that the links from it reach a real model.
            case.body = {**body, "project": "fuzz", "base_model": TINY}

    def send(self, case: schemathesis.Case, stateful: bool = False) -> schemathesis.Response:
        self.steer(case, stateful)
        self.cases += 1
        started = time.monotonic()
        try:
            response = case.call(**self.kwargs)
        except requests.RequestException as e:  # a timeout (a hang), a dropped connection (a crash)
            self.failures.append(e)
            raise
        took = time.monotonic() - started
        code = ""
        if response.status_code >= 400:
            try:
                code = response.json()["error"]["code"]
            except Exception:  # not the error shape: the checks below say how
                code = "?"
        self.statuses[(case.operation.label, response.status_code, code)] += 1
        if case.operation.label == "POST /artcloud/models/{name}/train" and response.status_code in (200, 202):
            self.jobs.add(response.json()["job_id"])
        self.slowest = sorted([*self.slowest, (took, case.operation.label, response.status_code)], reverse=True)[:5]
        try:
            case.validate_response(response, checks=CHECKS, headers=self.headers, transport_kwargs=self.kwargs)
        except FailureGroup as e:
            self.failures.append(e)
            raise
        return response

    def summary(self) -> str:
        lines = [f"{self.cases} cases:"]
        lines += [f"  {label} -> {status} {code}: {n}" for (label, status, code), n in sorted(self.statuses.items())]
        lines.append("slowest: " + ", ".join(f"{label} -> {status} in {took:.1f} s" for took, label, status in self.slowest))
        return "\n".join(lines)

    def answered(self, label: str, status: int, since: Counter | None = None) -> int:
        counts = self.statuses - (since or Counter())
        return sum(n for (lbl, st, _), n in counts.items() if (lbl, st) == (label, status))


def bound_arrays(node: Any) -> None:
    """maxItems on the arrays of the request schemas (see MAX_ITEMS)."""
    if isinstance(node, dict):
        if node.get("type") == "array" and node.get("minItems", 0) <= MAX_ITEMS:
            node["maxItems"] = min(node.get("maxItems", MAX_ITEMS), MAX_ITEMS)
        for value in node.values():
            bound_arrays(value)
    elif isinstance(node, list):
        for value in node:
            bound_arrays(value)


def load_schema(server) -> Any:
    """The schema the live server serves at /openapi.json (behind its token)."""
    with server.client() as c:
        r = c.get("/openapi.json")
        assert r.status_code == 200, r.text
        raw = r.json()
    # Only the models that request bodies alone use: what a response holds stays as the server says.
    models = raw["components"]["schemas"]

    def used(node: Any) -> set[str]:
        found: set[str] = set()
        todo = [node]
        while todo:
            text = json.dumps(todo.pop())
            for name in models:
                if f'"#/components/schemas/{name}"' in text and name not in found:
                    found.add(name)
                    todo.append(models[name])
        return found

    requests_use = used([op.get("requestBody") for path in raw["paths"].values() for op in path.values()])
    responses_use = used([op["responses"] for path in raw["paths"].values() for op in path.values()])
    for name in requests_use - responses_use:
        bound_arrays(models[name])
    # Failure reports hide the token, not every field with `token` in its name (max_tokens).
    hide = ("authorization",)
    sanitization = SanitizationConfig(keys_to_sanitize=hide, sensitive_markers=hide)
    config = schemathesis.Config(output=OutputConfig(sanitization=sanitization))
    schema = schemathesis.openapi.from_dict(raw, config=config)
    schema.config.update(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"},
                         tls_verify=str(server.ca))
    for operation_id in EXCLUDED:
        schema = schema.exclude(operation_id=operation_id)
    return schema


@pytest.fixture
def fuzz_server(start_server):
    # No cap on models that a long stateful phase could reach: past it every walk's registration is a 409, no walk can
    # follow a link to a model it made, and none to a job (a make test once sent 8 walks, 4,952 calls, with no job
    # events answered). tests/test_limits.py holds the server to --max-models.
    server = start_server(None, "--max-request-tokens", MAX_REQUEST_TOKENS, "--max-models", "100000")
    with server.client() as c:
        r = c.post("/artcloud/models", json={"name": "agent", "project": "tests", "base_model": TINY})
        assert r.status_code == 200, r.text
    return server


def test_fuzz_live_server(fuzz_server):
    started = time.monotonic()
    schema = load_schema(fuzz_server)
    with fuzz_server.client() as c:
        groups = rollout_groups(c, "agent", ["Say a word."], n=2, max_tokens=4)
    fuzz = Fuzzer(fuzz_server.url, fuzz_server.token, str(fuzz_server.ca), groups)

    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 18 and not {op.definition.raw["operationId"] for op in operations} & EXCLUDED

    def check() -> None:
        if fuzz.failures:
            first = fuzz.failures[0]
            raise AssertionError(f"{len(fuzz.failures)} failures; the first:\n{first}\n{fuzz.summary()}") from first

    # Each operation on its own, with valid and with invalid requests.
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @seed(FUZZ_SEED)
            @settings(max_examples=STATELESS_EXAMPLES.get(operation.definition.raw["operationId"], STATELESS_DEFAULT),
                      **SETTINGS)
            @given(case=operation.as_strategy(generation_mode=mode))
            def one(case: schemathesis.Case) -> None:
                fuzz.send(case)

            try:
                one()
            except Unsatisfiable:
                # No invalid request exists: GET /health takes nothing, GET /v1/models/{model_id} any string.
                if mode != GenerationMode.NEGATIVE:
                    raise
            finally:
                check()
    stateless, stateless_statuses = fuzz.cases, Counter(fuzz.statuses)

    # Sequences through the links: a registered model's name, a started job's id.
    class Machine(schema.as_state_machine()):
        def call(self, case: schemathesis.Case, **kwargs: Any) -> schemathesis.Response:
            return fuzz.send(case, stateful=True)

        def validate_response(self, response, case, additional_checks=None, **kwargs) -> None:
            pass  # fuzz.send checked it

    # The stateful phase must follow the links to real models and real jobs. Which links a seeded walk takes
    # depends on the server's answers (a job still running, a 429): it goes on with the next seed until it has
    # made STATEFUL_CASES calls and each link was answered, in at most 8 runs.
    linked = [("POST /artcloud/models", 200), ("GET /artcloud/models/{name}", 200),
              ("PUT /artcloud/models/{name}/temperature", 200), ("POST /artcloud/models/{name}/train", 202),
              ("GET /artcloud/jobs/{job_id}", 200), ("GET /artcloud/jobs/{job_id}/events", 200)]

    def unreached() -> list[str]:
        return [f"{status} from {label}" for label, status in linked
                if fuzz.answered(label, status, since=stateless_statuses) == 0]

    def drain() -> None:
        """Every training job the fuzzer started has ended: each walk starts on an idle server, whatever the machine's
        load. Jobs left queued by the stateless phase (or the walk before) made a walk's trains 429 too_many_jobs on
        a loaded machine, so the walk never followed a link to a job (a clean make test, 8 walks)."""
        deadline = time.monotonic() + 600
        with fuzz_server.client() as c:
            for job_id in sorted(fuzz.jobs):
                while (status := c.get(f"/artcloud/jobs/{job_id}").json()["status"]) in ("queued", "running"):
                    assert time.monotonic() < deadline, f"job {job_id} still {status} after 600 s"
                    time.sleep(0.2)

    attempt = 0
    while fuzz.cases - stateless < STATEFUL_CASES or unreached():
        drain()
        assert attempt < 8, (f"the stateful phase sent {fuzz.cases - stateless} cases in {attempt} runs; never got "
                             f"{', '.join(unreached()) or 'nothing missing'}\n{fuzz.summary()}")
        try:
            seed(FUZZ_SEED + attempt)(Machine).run(settings=settings(
                max_examples=STATEFUL_SCENARIOS, stateful_step_count=STATEFUL_STEPS, **SETTINGS))
        except FlakyStrategyDefinition:
            # The server's state (models and jobs from earlier scenarios) changed which links could be
            # followed when hypothesis went back over a scenario: go on with the next seed.
            pass
        finally:
            check()
        attempt += 1

    # A training step that failed on the server's side is a 500 too, only later: in the job's events.
    with fuzz_server.client() as c:
        for job_id in sorted(fuzz.jobs):
            events = [json.loads(line) for line in c.get(f"/artcloud/jobs/{job_id}/events").text.splitlines() if line]
            assert events and events[-1]["type"] in ("end", "error"), (job_id, events)
            assert events[-1]["data"].get("code") != "internal_error", (job_id, events[-1])

    print(f"\nfuzzed in {time.monotonic() - started:.0f} s: {stateless} stateless cases, "
          f"{fuzz.cases - stateless} stateful in {attempt} runs\n{fuzz.summary()}")
    assert fuzz.cases >= MIN_CASES, fuzz.summary()

"""Inference replicas (several nodes): the head's ReplicaSet and `artcloud replica` servers.

The routing and failure rules are tested on the set with samplers of this file (each phase reached by a
barrier); the whole path with real processes: a head `artcloud serve --replica ...` and two `artcloud replica`
servers over HTTPS with one launch's certificate and token, on tiny-random.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import httpx
import pytest
from helpers import rollout_groups, train, wait_for

from artcloud.server.engines.base import (
    Completion,
    EngineError,
    GenerationRequest,
    RequestRefused,
    Sampler,
    SamplerUnavailable,
    SamplingParams,
    TokenSink,
)
from artcloud.server.engines.replicas import SPILL, ReplicaSet
from artcloud.tls import make_launch_secrets
from artcloud.types import LoraConfig

TINY = "artcloud/tiny-random"


class Scripted(Sampler):
    """A sampler whose answers the test decides: it records what it got, can be held at a barrier, fail, or
    send a token before failing."""

    max_context = 64

    def __init__(self, name: str):
        self.name = name
        self.calls: list[list[list[int]]] = []
        self.adapters: dict[str, Path] = {}
        self.down = False
        self.fail_after_token = False
        self.hold: threading.Event | None = None
        self.arrived = threading.Event()

    def generate(self, slot, requests):
        self.arrived.set()
        if self.hold is not None:
            assert self.hold.wait(30)
        if self.down:
            raise SamplerUnavailable(f"{self.name} is gone")
        if self.fail_after_token:
            for r in requests:
                if r.sink is not None:
                    r.sink.tokens(0, [1], [-0.5], None)
            raise EngineError(f"{self.name} died mid-stream")
        self.calls.append([r.prompt_ids for r in requests])
        return [[Completion([7], [-0.1], None, "stop", self.name, 1.0)] * r.n for r in requests]

    def serve_adapter(self, slot, lora, folder):
        if self.down:
            raise SamplerUnavailable(f"{self.name} is gone")
        self.adapters[slot] = folder

    def drop_adapter(self, slot):
        self.adapters.pop(slot, None)

    def status(self):
        if self.down:
            raise SamplerUnavailable(f"{self.name} is gone")
        return {"kind": "scripted", "state": "ready"}


def request(prompt: list[int], n: int = 1, sink: TokenSink | None = None) -> GenerationRequest:
    return GenerationRequest(prompt_ids=prompt, n=n, params=SamplingParams(max_tokens=4), sink=sink)


def served_by(completions) -> str:
    return completions[0].text


def test_a_prompt_keeps_its_replica_and_moves_only_when_that_one_is_loaded_or_gone(tmp_path):
    a, b, c = Scripted("a"), Scripted("b"), Scripted("c")
    replicas = ReplicaSet([a, b, c], names=["a", "b", "c"], recheck_s=3600)
    try:
        prompts = [[i] * 40 for i in range(30)]
        first = [served_by(replicas.generate(None, [request(p)])[0]) for p in prompts]
        assert set(first) == {"a", "b", "c"}  # spread
        # The next turn (the prompt seen before, then more) goes to the same replica, whose cache holds it.
        again = [served_by(replicas.generate(None, [request(p + [99] * 20)])[0]) for p in prompts]
        assert again == first
        # A prompt that only begins like one seen before (a shared system prompt) is free to go elsewhere.
        shared = [served_by(replicas.generate(None, [request(prompts[0][:16] + [i] * 60)])[0]) for i in range(100, 130)]
        assert set(shared) == {"a", "b", "c"}

        # Load: a held replica with SPILL samples in flight sends the next prompt of its own to the least loaded.
        mine = [p for p, r in zip(prompts, first) if r == "a"]
        a.hold = threading.Event()
        busy = threading.Thread(target=replicas.generate, args=(None, [request(mine[0], n=SPILL)]))
        busy.start()
        assert a.arrived.wait(30)
        assert served_by(replicas.generate(None, [request(mine[1])])[0]) != "a"
        a.hold.set()
        busy.join(30)

        # Gone: its requests go to the others, it leaves the rotation, and comes back with every adapter.
        replicas.serve_adapter("s1", LoraConfig(), tmp_path / "1")
        a.down = True
        out = [replicas.generate(None, [request(p)])[0] for p in mine]
        assert all(served_by(cs) in ("b", "c") for cs in out) and replicas.moved == 1  # then it is out
        status = replicas.status()
        assert [r["live"] for r in status["replicas"]] == [False, True, True]
        assert "a is gone" in status["replicas"][0]["last_error"]
        replicas.serve_adapter("s2", LoraConfig(), tmp_path / "2")  # published while it was out
        assert replicas.check() == []  # still gone
        a.down = False
        assert replicas.check() == ["a"]
        assert a.adapters == {"s1": tmp_path / "1", "s2": tmp_path / "2"}
        assert served_by(replicas.generate(None, [request(mine[0])])[0]) != "a"  # its prompts stay where they went
        assert "a" in {served_by(replicas.generate(None, [request([i] * 40)])[0]) for i in range(200, 230)}

        replicas.drop_adapter("s1")
        assert "s1" not in a.adapters and "s1" not in b.adapters
    finally:
        replicas.close()


def test_a_streamed_request_that_sent_tokens_fails_with_503_alone_and_none_is_lost_silently():
    """Its replica failed after its first tokens: that request fails (503, to send again); the other requests of
    the same call are answered, by the other replica (code review 3, F5: every request of the batch failed)."""
    class Sink(TokenSink):
        def __init__(self):
            self.got = []

        def tokens(self, sample, token_ids, logprobs, top_logprobs):
            self.got.append(token_ids)

    a, b = Scripted("a"), Scripted("b")
    replicas = ReplicaSet([a, b], names=["a", "b"], recheck_s=3600)
    try:
        prompt = next([i] for i in range(100) if served_by(replicas.generate(None, [request([i])])[0]) == "a")
        other = next([i] for i in range(100, 200) if served_by(replicas.generate(None, [request([i])])[0]) == "b")
        a.fail_after_token = True
        sink = Sink()
        streamed, plain, moved = replicas.generate(None, [request(prompt, sink=sink), request(other), request(prompt)])
        assert isinstance(streamed, SamplerUnavailable) and "after its first tokens" in str(streamed)
        assert served_by(plain) == "b" and served_by(moved) == "b"  # the one not yet streamed went to b
        assert sink.got == [[1]] and replicas.status()["live"] == 1
        # Not yet streamed: moved, and the caller's sink is its own again afterwards.
        quiet = Sink()
        req = request(prompt, sink=quiet)
        assert served_by(replicas.generate(None, [req])[0]) == "b" and req.sink is quiet

        b.down = True
        with pytest.raises(SamplerUnavailable, match="every inference replica is down"):
            replicas.generate(None, [request(prompt)])
        assert [r["in_flight"] for r in replicas.status()["replicas"]] == [0, 0]
    finally:
        replicas.close()


def test_a_request_a_replica_refuses_fails_alone_and_the_replica_stays():
    """A 4xx of a replica (or of vLLM) is about the request, not the replica: the request fails with it, nothing leaves
    the rotation, and the next request is served (code review 3, F6: the request went from replica to replica, each
    left the rotation, and every request then got "every inference replica is down")."""
    class Refusing(Scripted):
        def generate(self, slot, requests):
            if any(99 in r.prompt_ids for r in requests):
                raise RequestRefused(f"replica {self.name} refused POST /replica/generate: 400 (this request only)")
            return super().generate(slot, requests)

    a, b = Refusing("a"), Refusing("b")
    replicas = ReplicaSet([a, b], names=["a", "b"], recheck_s=3600)
    try:
        (refused,) = replicas.generate(None, [request([99, 1])])
        assert isinstance(refused, RequestRefused) and replicas.moved == 0
        assert replicas.status()["live"] == 2
        assert {served_by(replicas.generate(None, [request([i] * 20)])[0]) for i in range(40)} == {"a", "b"}
    finally:
        replicas.close()


def test_replicas_out_of_the_rotation_are_checked_at_once():
    """One replica loading its model again (minutes on a GPU; held here) does not keep another that answers out of
    the rotation meanwhile (security review 3, N10: they were checked one after another)."""
    class Loading(Scripted):
        def __init__(self, name):
            super().__init__(name)
            self.armed, self.loading, self.loaded = False, threading.Event(), threading.Event()

        def status(self):
            if self.armed:
                self.loading.set()
                assert self.loaded.wait(30)
            return super().status()

    a, b = Loading("a"), Scripted("b")
    replicas = ReplicaSet([a, b], names=["a", "b"], recheck_s=3600)
    try:
        for r in replicas.replicas:
            replicas._fail(r, SamplerUnavailable(f"{r.name} restarted"))
        a.armed = True
        back: list[list[str]] = []
        checking = threading.Thread(target=lambda: back.append(replicas.check()))
        checking.start()
        assert a.loading.wait(30)
        wait_for("b back in the rotation while a loads", lambda: [r["live"] for r in replicas.status()["replicas"]]
                 == [False, True], 30)
        a.loaded.set()
        checking.join(30)
        assert back == [["a", "b"]]
    finally:
        a.loaded.set()
        replicas.close()


def test_a_sampler_sharing_the_trainers_weights_is_refused():
    shared = Scripted("a")
    shared.shares_trainer_weights = True
    with pytest.raises(ValueError, match="shares the trainer's weights"):
        ReplicaSet([shared])


# ----------------------------------------------------------------------------------------- real processes


class Replica:
    """`artcloud replica` as a child process, with the launch's files."""

    def __init__(self, path: Path, secrets: Path, port: int = 0, env: dict[str, str] | None = None):
        self.path, self.secrets, self.port, self.env = path, secrets, port, env or {}
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.log = path.parent / f"{path.name}.log"

    def start(self) -> "Replica":
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **self.env}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "artcloud", "replica", "--path", str(self.path), "--port", str(self.port),
                 "--tls-cert", str(self.secrets / "server.pem"), "--tls-key", str(self.secrets / "server.key"),
                 "--token-file", str(self.secrets / "token")], stdout=log, stderr=subprocess.STDOUT, env=env)
        found = wait_for("the replica's URL", lambda: re.findall(r"serving on (https://\S+)", self.log.read_text()) or
                         (self.proc.poll() is not None and ["exited"]), 120)
        assert found[-1] != "exited", self.log.read_text()
        self.url = found[-1]
        self.port = int(self.url.rsplit(":", 1)[1])
        return self

    def status(self) -> dict:
        token = (self.secrets / "token").read_text().strip()
        with httpx.Client(verify=str(self.secrets / "ca.pem"), headers={"Authorization": f"Bearer {token}"}) as c:
            return c.get(f"{self.url}/replica/status").json()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_head_spreads_rollouts_over_replicas_and_hands_every_step_to_each(start_server, tmp_path):
    launch = tmp_path / "head" / ".tls"  # the launch's files: the head serves with them (and trusts their CA)
    make_launch_secrets(hosts=["127.0.0.1"]).write(launch)
    replicas = [Replica(tmp_path / f"replica{i}", launch).start() for i in (1, 2)]
    try:
        head = start_server(tmp_path / "head", *[a for r in replicas for a in ("--replica", r.url)])
        with head.client() as c:
            assert c.post("/artcloud/models", json={"name": "agent", "project": "p", "base_model": TINY}).status_code == 200

            def sampler() -> dict:
                return c.get("/artcloud/status").json()["engines"][0]["sampler"]

            assert [r["live"] for r in sampler()["replicas"]] == [True, True, True]
            prompts = [f"prompt number {i}" for i in range(12)]
            groups = rollout_groups(c, "agent", prompts, n=2)
            served = [r["served"] for r in sampler()["replicas"]]
            assert all(served) and sum(served) == len(prompts), served  # every node took some
            assert [r.status()["served"] for r in replicas] == served[1:]

            end = train(c, "agent", groups, learning_rate=1e-2)[-1]
            assert end["type"] == "end", end
            for r in replicas:  # steps 0 and 1, the trained one served under the model's slot
                assert len(r.status()["adapters"]) >= 1

            # A replica's node goes: its rollouts go elsewhere, none fails.
            replicas[0].kill()
            rollout_groups(c, "agent@1", prompts, n=2)
            status = sampler()
            assert [r["live"] for r in status["replicas"]] == [True, False, True] and status["moved"] > 0

            # Its supervisor starts it again (same port): the head gives it the adapters again, and it rejoins.
            replicas[0] = Replica(tmp_path / "replica1", launch, port=replicas[0].port).start()
            wait_for("replica1 back", lambda: sampler()["replicas"][1]["live"], 180)
            assert len(replicas[0].status()["adapters"]) >= 1
            before = replicas[0].status()["served"]
            rollout_groups(c, "agent@1", [f"another prompt {i}" for i in range(12)], n=2)  # new ones: spread again
            assert replicas[0].status()["served"] > before
        head.stop()
    finally:
        for r in replicas:
            r.kill()
    assert all(r.proc.poll() is not None for r in replicas)


def test_a_replica_takes_bodies_as_large_as_the_heads_but_adapters(tmp_path):
    """Security review 3, N7: the replica's app had no body limit (96 MiB held its /health 2.9 s). It has the head's,
    from the declared length on; an adapter's upload, streamed to disk under its own cap, is not held to it."""
    from fastapi.testclient import TestClient

    from artcloud.server.replica import LIMITS, create_replica_app

    token = "t" * 43
    auth = {"Authorization": f"Bearer {token}", "Content-Length": str(LIMITS.max_body_bytes + 1)}
    with TestClient(create_replica_app(lambda base, args: None, token, tmp_path)) as c:
        for route in ("/replica/generate", "/replica/models"):
            refused = c.post(route, content=b"{}", headers=auth)
            assert refused.status_code == 413 and refused.json()["error"]["code"] == "body_too_large", refused.text
        upload = c.put("/replica/adapters/s1", content=b"", headers=auth)  # past the limit: the route's own answer
        assert upload.status_code == 400 and upload.json()["error"]["field"] == "X-Artcloud-Lora", upload.text


def test_a_replica_refuses_a_hostile_adapter_and_requests_without_the_token(tmp_path):
    """And it takes engine_args as the head does (security review 3, N3: any vLLM flag a token holder sent), over the
    operator's, which it reads from its own launch as the head does (code review 3, F4: they never reached it)."""
    secrets = make_launch_secrets(hosts=["127.0.0.1"]).write(tmp_path / "launch")
    replica = Replica(tmp_path / "replica", tmp_path / "launch", env={"ARTCLOUD_ENGINE_ARGS": '{"max_model_len": 48}'}).start()
    token = secrets.token.read_text().strip()
    try:
        with httpx.Client(verify=str(secrets.ca_cert), base_url=replica.url, timeout=120) as c:
            assert c.get("/health").json() == {"ok": True}
            assert c.get("/replica/status").status_code == 401
            auth = {"Authorization": f"Bearer {token}"}
            garbled = c.post("/replica/models", content=b"{not json", headers=auth)
            assert garbled.status_code == 400 and garbled.json()["error"]["field"] == "body"
            for flag, value in (("trust_remote_code", True), ("uds", "/tmp/x.sock"), ("api_key", "k"), ("model", "m")):
                refused = c.post("/replica/models", json={"base_model": TINY, "engine_args": {flag: value}}, headers=auth)
                assert refused.status_code == 400 and refused.json()["error"]["field"] == f"engine_args.{flag}", refused.text
            assert replica.status()["base_model"] is None  # nothing was loaded
            assert c.post("/replica/models", json={"base_model": TINY}, headers=auth).status_code == 200
            assert replica.status()["max_context"] == 48  # the operator's
            other = c.post("/replica/models", json={"base_model": "someone/else"}, headers=auth)
            assert other.status_code == 409 and other.json()["error"]["field"] == "base_model"

            def tar(*members: tuple[str, bytes]) -> bytes:
                import io

                raw = io.BytesIO()
                with tarfile.open(fileobj=raw, mode="w:") as t:
                    for name, data in members:
                        info = tarfile.TarInfo(name)
                        info.size = len(data)
                        t.addfile(info, io.BytesIO(data))
                return raw.getvalue()

            def gnu_sparse(name: bytes, declared: int) -> bytes:
                """An old-GNU sparse member (type 'S'): one 512-byte block stored, `declared` bytes once extracted
                (the holes read as zeros); the real size in base-256, so that it may pass 8 GiB."""
                h = bytearray(512)
                h[0:len(name)] = name
                for at, field in ((100, b"0000644\0"), (108, b"0000000\0"), (116, b"0000000\0")):
                    h[at:at + 8] = field
                h[124:136], h[136:148], h[156:157], h[257:265] = b"%011o\0" % 512, b"%011o\0" % 0, b"S", b"ustar  \0"
                h[386:398], h[398:410] = b"%011o\0" % 0, b"%011o\0" % 512  # the map: (offset 0, 512 bytes)
                h[483:495] = b"\x80" + declared.to_bytes(11, "big")
                h[148:156] = b" " * 8
                h[148:156] = b"%06o\0 " % sum(h)
                return bytes(h) + b"\0" * 512

            lora = {"X-Artcloud-Lora": LoraConfig().model_dump_json(), **auth}
            # Security review 3, N4: 3 KiB that tarfile extracts as 2 GiB (its isfile() is True for a sparse member).
            bomb = tar(("adapter_config.json", b"{}"))[:1024] + gnu_sparse(b"adapter_model.safetensors", 2 << 30) + b"\0" * 1024
            with tarfile.open(fileobj=io.BytesIO(bomb)) as t:
                assert [(m.name, m.size, m.isfile()) for m in t.getmembers()][1] == ("adapter_model.safetensors", 2 << 30, True)
            refused = c.put("/replica/adapters/s1", content=bomb, headers=lora)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_adapter", refused.text
            assert not any((tmp_path / "replica" / "replica-adapters").iterdir())
            garbage = c.put("/replica/adapters/s1", content=tar(("adapter_config.json", b"{}"),
                                                                 ("adapter_model.safetensors", b"not safetensors")),
                            headers=lora)
            assert garbage.status_code == 400 and "not a PEFT adapter" in garbage.text, garbage.text
            escape = c.put("/replica/adapters/s1", content=tar(("../../evil", b"x"), ("adapter_config.json", b"{}")),
                           headers=lora)
            assert escape.status_code == 400 and escape.json()["error"]["code"] == "invalid_adapter"
            assert not (tmp_path / "evil").exists() and not any((tmp_path / "replica" / "replica-adapters").iterdir())
            assert c.put("/replica/adapters/..", content=b"", headers=lora).status_code in (400, 404)
            no_lora = c.put("/replica/adapters/s1", content=tar(), headers=auth)
            assert no_lora.status_code == 400 and "X-Artcloud-Lora" in no_lora.text
            bad = c.post("/replica/generate", json={"slot": None, "requests": [{"prompt_ids": [1, -2], "n": 1}]},
                         headers=auth)
            assert bad.status_code == 400 and bad.json()["error"]["field"] == "requests[0].prompt_ids"
            # The head's bound on n x max_tokens (security review 3, N7; the body's size: the test below).
            greedy = c.post("/replica/generate", json={"slot": None, "requests": [
                {"prompt_ids": [1], "n": 1024, "params": {"max_tokens": 1 << 20}}]}, headers=auth)
            assert greedy.status_code == 400 and greedy.json()["error"]["field"] == "requests[0].params.max_tokens"
            unknown = c.post("/replica/generate", json={"slot": "nope", "requests": [{"prompt_ids": [1], "n": 1}]},
                             headers=auth)
            assert unknown.status_code == 404
            ok = c.post("/replica/generate", json={"slot": None, "requests": [
                {"prompt_ids": [1, 2, 3], "n": 2, "params": {"max_tokens": 3, "temperature": 0}, "stream": True}]},
                headers=auth)
            lines = [json.loads(x) for x in ok.text.splitlines()]
            assert lines[-1]["done"][0][0]["token_ids"] == lines[-1]["done"][0][1]["token_ids"]  # greedy, twice
            assert sum(1 for x in lines if "tokens" in x) >= 2  # each sample's tokens streamed first
    finally:
        replica.kill()


def test_a_replica_stops_once_the_head_it_served_is_gone_and_not_while_it_is_busy(start_server, tmp_path):
    """`artcloud replica --head URL` (and `artcloud trainer-node`): the head answered, then went; the node stops (its
    loop then ends, and with it the job, so that SkyPilot's autodown takes the cluster). A head that does not answer
    for a while (frozen here: its connections wait in the kernel's backlog, as a busy head's do) is not gone (security
    review 3, N8), unless it stays silent past the unreachable limit (a machine gone without a word); one that never
    answered is given up after its own limit. Polled every 0.1 s here (10 s on a cluster)."""
    from artcloud.server.replica import watch_head

    head = start_server(tmp_path / "head")
    patient, hasty, lost = threading.Event(), threading.Event(), threading.Event()
    kw = dict(every_s=0.1, misses=3, timeout_s=0.3)
    watcher = watch_head(head.url, str(head.ca), patient.set, unreachable_s=3600, **kw)
    short = watch_head(head.url, str(head.ca), hasty.set, unreachable_s=2.0, **kw)
    wait_for("both watchers to see the head", lambda: watcher.answered and short.answered, 30)
    os.kill(head.proc.pid, signal.SIGSTOP)
    try:
        assert hasty.wait(30) and short.unanswered >= 3  # silent past 2 s: gone
        wait_for("5 unanswered polls", lambda: watcher.unanswered >= 5, 30)
        assert not patient.is_set() and watcher.refused == 0  # busy, not gone
    finally:
        os.kill(head.proc.pid, signal.SIGCONT)
    answered = watcher.answered
    wait_for("the head answering again", lambda: watcher.answered > answered, 30)
    head.stop()
    assert patient.wait(30) and watcher.refused >= 3 and not watcher.join(5) and not watcher.is_alive()

    with socket.socket() as s:  # a port where nothing ever listened
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    never = watch_head(f"https://127.0.0.1:{port}", None, lost.set, never_seen_s=1.0, **kw)
    assert lost.wait(30) and never.answered == 0 and never.refused >= 3

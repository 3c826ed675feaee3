"""The client against servers that vanish for real: a SIGSTOPped server process mid-train (issue 14, point 11).

A stopped process keeps its sockets open: the kernel still acks TCP, so the client sees no error, only
silence. Without a read timeout on the event stream, `model.train()` would wait for ever.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

import artcloud
from artcloud.backends.client import ServerGone

TINY = "artcloud/tiny-random"
READ_TIMEOUT_S = 3.0
PROBE_TIMEOUT_S = 2.0


async def rollout(client, name: str, prompt: str) -> artcloud.Trajectory:
    messages = [{"role": "user", "content": prompt}]
    r = await client.chat.completions.create(model=name, messages=messages, max_tokens=8, logprobs=True)
    choice = r.choices[0]
    return artcloud.Trajectory(messages_and_choices=[*messages, choice], reward=len(choice.message.content or "") / 20)


async def registered_with_groups(backend, name: str, prompts: int = 2):
    model = artcloud.TrainableModel(name=name, project="faults", base_model=TINY)
    await model.register(backend)
    client = model.openai_client()
    groups = await artcloud.gather_trajectory_groups(
        [artcloud.TrajectoryGroup(rollout(client, name, f"p{i}") for _ in range(4)) for i in range(prompts)], progress=False)
    for g in groups:
        g.trajectories[0].reward += 1.0  # rewards never all equal: every group trains
    return model, groups


def train_body(groups, key: str, gradient_steps: int) -> dict:
    return {"groups": [g.to_wire() for g in groups], "config": artcloud.TrainConfig(gradient_steps=gradient_steps).model_dump(),
            "idempotency_key": key}


def test_server_stopped_mid_train_raises_server_gone_within_the_read_timeout(tmp_path):
    """SIGSTOP the server right after a job is posted: following it raises ServerGone within read timeout
    + /health probe timeout (+ a margin), naming the job; once resumed, the job's events are all there."""

    async def main():
        backend = artcloud.LocalBackend(path=tmp_path / "local", event_read_timeout_s=READ_TIMEOUT_S,
                                        health_probe_timeout_s=PROBE_TIMEOUT_S)
        async with backend:
            _, groups = await registered_with_groups(backend, "stopped")
            job = await backend.start_train("stopped", train_body(groups, "stop-1", gradient_steps=4))
            pid = backend._proc.pid
            os.kill(pid, signal.SIGSTOP)  # as a preempted VM or a partition looks from here: silence
            try:
                started = time.monotonic()
                bound = READ_TIMEOUT_S + PROBE_TIMEOUT_S + 1.0
                with pytest.raises(ServerGone) as gone:
                    # wait_for turns a hang (no read timeout) into a failure of this test, not of the suite.
                    await asyncio.wait_for(backend.follow_job(job.job_id), bound + 20.0)
                elapsed = time.monotonic() - started
                assert elapsed < bound + 3.0, elapsed
                message = str(gone.value)
                assert job.job_id in message and gone.value.code == "server_unreachable"
                assert f"no event nor keep-alive for {READ_TIMEOUT_S:.0f} s" in message
                assert f"GET /health did not answer within {PROBE_TIMEOUT_S:.0f} s" in message
            finally:
                os.kill(pid, signal.SIGCONT)
            # The server was only paused: the same job, followed again from the start, ends normally.
            events = await asyncio.wait_for(backend.follow_job(job.job_id), 120)
            assert [e.seq for e in events] == list(range(1, len(events) + 1)) and events[-1].type == "end"
            return pid

    pid = asyncio.run(main())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_quiet_stream_from_a_live_server_reconnects_and_loses_nothing(tmp_path, caplog):
    """A job queued behind a long one is silent for longer than the read timeout while /health answers:
    the client reconnects from its cursor instead of giving up."""

    async def main():
        backend = artcloud.LocalBackend(path=tmp_path / "local", event_read_timeout_s=1.0, health_probe_timeout_s=10.0)
        async with backend:
            _, groups = await registered_with_groups(backend, "queued")
            # Three jobs of 64 gradient steps (64 groups) ahead: seconds of silence on the last one's stream.
            ahead = [await backend.start_train("queued", train_body(groups * 32, f"long-{i}", gradient_steps=64))
                     for i in range(3)]
            second = await backend.start_train("queued", train_body(groups, "after-1", gradient_steps=1))
            with caplog.at_level(logging.INFO, logger="artcloud.client"):
                events = await asyncio.wait_for(backend.follow_job(second.job_id), 300)
            first_events = await backend.follow_job(ahead[0].job_id)
            return events, first_events

    events, first_events = asyncio.run(main())
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [e.type for e in events] == ["queued", "start", "step", "end"]
    assert first_events[-1].type == "end"
    assert any("/health answers 200: reconnecting" in r.getMessage() for r in caplog.records), \
        "the queued job's stream was never silent for 1 s: make the first job longer"


def test_a_liveness_check_waits_for_a_replacement_in_flight():
    """Rollouts fail together when a spot machine goes: one replaces the server while the others ask
    `recover_if_lost`. Checked meanwhile, the new machine (still starting: SkyPilot's INIT) looked dead and
    was torn down mid-launch (seen in a clean make test). Each check must wait for the replacement instead,
    then go again on the new server. The provider hooks are what LocalBackend and SkyBackend implement."""
    from artcloud.backends.remote import RemoteBackend

    class Provider(RemoteBackend):
        def __init__(self) -> None:
            super().__init__("https://127.0.0.1:9", token="t" * 32, ca_cert=None, check_hostname=False)
            self.launching = asyncio.Event()
            self.release = asyncio.Event()
            self.checked_while_launching = 0
            self.launches = 0
            self.in_flight = False

        async def _check_alive(self) -> None:
            if self.in_flight:
                self.checked_while_launching += 1  # would have found the half-launched machine dead
            if self.launches == 0:
                raise ServerGone("the cluster is gone", code="cluster_gone")

        async def _replace_server(self, cause: BaseException) -> dict:
            self.launches += 1
            self.in_flight = True
            self.launching.set()
            await self.release.wait()
            self.in_flight = False
            return {"sandbox": "spot", "reason": str(cause)}

    async def main() -> Provider:
        backend = Provider()
        generation = backend.generation
        gone = ServerGone("connection refused")
        first = asyncio.ensure_future(backend.recover_if_lost(gone, generation))
        await backend.launching.wait()
        others = [asyncio.ensure_future(backend.recover_if_lost(gone, generation)) for _ in range(3)]
        await asyncio.sleep(0.2)
        backend.release.set()
        assert await first is True and await asyncio.gather(*others) == [True, True, True]
        return backend

    backend = asyncio.run(main())
    assert backend.launches == 1 and backend.checked_while_launching == 0 and len(backend.replacements) == 1


def _hold_the_replacements_register(monkeypatch) -> dict[str, asyncio.Event]:
    """A barrier in a replacement: its register (RemoteBackend.register with take_over) sets "registering", then
    waits for "go". The test adds its own events to the dict."""
    from artcloud.backends.remote import RemoteBackend

    register = RemoteBackend.register
    held = {"registering": asyncio.Event(), "go": asyncio.Event()}

    async def held_register(self, *args, take_over: bool = False, **kwargs):
        if take_over:  # the replacement's
            held["registering"].set()
            await held["go"].wait()
        return await register(self, *args, take_over=take_over, **kwargs)

    monkeypatch.setattr(RemoteBackend, "register", held_register)
    return held


def _replaceable_backend(tmp_path) -> artcloud.LocalBackend:
    """A LocalBackend whose lost server is replaced, as SkyBackend(spot=True, s3=...) replaces its machine."""
    backend = artcloud.LocalBackend(tmp_path / "machine", lease="10m")
    backend.relaunch_on_loss = True  # what SkyBackend(spot=True, s3=...) sets

    async def lost(cause: BaseException) -> bool:  # SkyProvisioner.lost: the machine is gone
        return True

    backend.provisioner.lost = lost
    return backend


async def _lose_the_machine(backend: artcloud.LocalBackend, tmp_path) -> str:
    """The machine goes (a preempted spot VM): its server SIGKILLed, and the next one on a new machine's disk, with
    nothing on it. The lost server's URL."""
    lost_url = backend.base_url
    backend.provisioner.path = tmp_path / "new-machine"
    backend.provisioner.log_file = backend.provisioner.path / "server.log"
    os.kill(backend.provisioner.proc.pid, signal.SIGKILL)
    # Gone for good before anyone asks: its port closes before it can be reaped, and a liveness check in between
    # would find a machine that still runs (a LocalBackend's race, not the one tested here).
    await asyncio.to_thread(backend.provisioner.proc.wait, 30)
    return lost_url


def test_a_replacement_is_published_only_once_its_models_are_back(tmp_path, monkeypatch):
    """A lost machine (a preempted spot VM, played by a SIGKILLed LocalBackend server and a fresh, empty disk) is
    replaced while rollouts go on. The new server must not be reached before the models are registered on it again
    (code review 3, F2: 23 of ~370 rollouts got 404 model_not_found in that window). The replacement is held in its
    register (a barrier); a rollout started then waits, and both rollouts answer once it is done."""
    from artcloud.backends.remote import RemoteBackend

    recover_if_lost = RemoteBackend.recover_if_lost
    held = _hold_the_replacements_register(monkeypatch)
    asked: list[int] = []

    async def counted(self, error, generation):
        asked.append(generation)
        if len(asked) == 2:
            held["second"].set()
        return await recover_if_lost(self, error, generation)

    monkeypatch.setattr(RemoteBackend, "recover_if_lost", counted)

    async def main() -> None:
        held["second"] = asyncio.Event()
        backend = _replaceable_backend(tmp_path)
        try:
            model = artcloud.TrainableModel(name="agent", project="p", base_model=TINY)
            await model.register(backend)
            client = model.openai_client(max_retries=0)

            async def rollout() -> str:
                r = await client.chat.completions.create(model="agent", max_tokens=2,
                                                         messages=[{"role": "user", "content": "hi"}])
                return r.model

            lost_url = await _lose_the_machine(backend, tmp_path)
            first = asyncio.ensure_future(rollout())  # fails on the lost server, and replaces it
            await _first_of(held["registering"].wait(), first)  # (a rollout that failed instead says why)
            assert (backend.base_url, backend.generation) == (lost_url, 0)  # nothing published yet
            second = asyncio.ensure_future(rollout())  # a rollout that starts in the window
            await _first_of(held["second"].wait(), second)  # it failed on the lost server too, and waits
            assert not second.done()
            held["go"].set()
            assert await asyncio.gather(first, second) == ["agent@0", "agent@0"]
            assert backend.generation == 1 and backend.base_url != lost_url and len(backend.replacements) == 1
        finally:
            await backend.down()

    asyncio.run(main())


def test_a_read_sent_while_a_replacement_is_in_flight_waits_for_it_and_asks_the_new_server(tmp_path, monkeypatch):
    """A read (GET) is retried for seconds; a replacement takes minutes (a new machine, the models registered again).
    A read the lost server fails meanwhile must wait for the replacement and go to the new server, not raise
    ServerGone when its retries run out (a clean make test: `backend.model_info` right after a lost node's
    replacement began). The replacement is held in its register until the read has failed and asked the backend's
    liveness check (barriers)."""
    held = _hold_the_replacements_register(monkeypatch)

    async def main() -> None:
        held["read_waits"] = asyncio.Event()
        backend = _replaceable_backend(tmp_path)
        try:
            model = artcloud.TrainableModel(name="agent", project="p", base_model=TINY)
            await model.register(backend)
            backend.client.retries = 2  # the read's own retries run out long before the replacement ends
            alive_or_replaced = backend.client.check_alive

            async def noted() -> None:
                if asyncio.current_task() is reading:
                    held["read_waits"].set()
                await alive_or_replaced()

            backend.client.check_alive = noted
            lost_url = await _lose_the_machine(backend, tmp_path)
            replacing = asyncio.ensure_future(backend.recover(ServerGone("the node is gone"), backend.generation))
            await _first_of(held["registering"].wait(), replacing)
            reading = asyncio.ensure_future(backend.model_info("agent"))
            await _first_of(held["read_waits"].wait(), reading)  # its retries failed on the lost server
            await asyncio.sleep(0.2)
            assert not reading.done(), reading  # it waits for the replacement, it did not give up
            held["go"].set()
            assert await replacing is True
            info = await reading
            assert info.name == "agent" and info.step == 0
            assert backend.generation == 1 and backend.base_url != lost_url
        finally:
            await backend.down()

    asyncio.run(main())


def test_a_liveness_check_that_asks_the_server_itself_asks_it_once():
    """RunnerBackend's liveness check asks the server's /health through the same client: a read that fails
    inside it must not ask the check again (it recursed for ever under `artcloud run`, a clean make test)."""
    from artcloud.backends.client import Client, Endpoint

    client = Client(Endpoint("https://127.0.0.1:9", "t" * 32, None, False), retries=2)  # port 9: nothing listens
    checks: list[int] = []

    async def check_alive() -> None:
        checks.append(1)
        await client.call("GET", "/health")  # fails: ServerGone, raised from the check

    client.check_alive = check_alive

    async def main() -> None:
        with pytest.raises(ServerGone) as e:
            await client.call("GET", "/artcloud/models/agent")
        assert e.value.code == "server_unreachable"
        await client.drop_connection()

    asyncio.run(main())
    assert checks == [1]


async def _first_of(barrier, task: asyncio.Future) -> None:
    """Wait at `barrier`; if `task` ends first, its error (or result) fails the test instead of a hang."""
    waiting = asyncio.ensure_future(barrier)
    await asyncio.wait({waiting, task}, timeout=120, return_when=asyncio.FIRST_COMPLETED)
    if not waiting.done():
        waiting.cancel()
        raise AssertionError(f"the barrier was never reached: {task.exception() if task.done() else 'a timeout'}")


def test_a_request_is_never_retried_on_the_server_that_replaced_its_own():
    """Client.call retries a request on the server it was sent to; once that server was replaced, the caller's
    recovery decides (code review 3, R1: a retried training POST landed on the new server between its replayed
    steps, and trained on the wrong parent). The replacement is made to happen while the first attempt is out."""
    from dataclasses import replace

    from artcloud.backends.client import Client, Endpoint

    client = Client(Endpoint("https://127.0.0.1:9", "t" * 32, None, False), retries=3)  # port 9: nothing listens
    sent: list[str] = []
    made = client._client

    def replaced_meanwhile():
        sent.append(client.endpoint.url)
        if len(sent) == 1:
            client.endpoint = replace(client.endpoint, url="https://127.0.0.1:10", generation=1)
        return made()

    client._client = replaced_meanwhile

    async def main() -> None:
        with pytest.raises(ServerGone) as e:
            await client.call("POST", "/artcloud/models/agent/train", json_body={})
        assert e.value.code == "server_replaced"
        await client.drop_connection()

    asyncio.run(main())
    assert sent == ["https://127.0.0.1:9"]  # one attempt, on the first server only


def test_one_liveness_check_answers_for_every_request_that_failed_before_it_began():
    """A blip under many rollouts: each failed request asks `recover_if_lost`, and each asked the provider (three
    SkyPilot API calls of seconds each), one after another (code review 3, R6). A check begun after a request failed
    answers for it: ten failures, the first check held while the nine others fail, make two checks."""
    from artcloud.backends.remote import RemoteBackend

    class Provider(RemoteBackend):
        def __init__(self) -> None:
            super().__init__("https://127.0.0.1:9", token="t" * 32, ca_cert=None, check_hostname=False)
            self.checks = 0
            self.checking, self.release = asyncio.Event(), asyncio.Event()

        async def _check_alive(self) -> None:
            self.checks += 1
            self.checking.set()
            await self.release.wait()  # alive

    async def main() -> tuple[Provider, list[bool]]:
        backend = Provider()
        blip = ServerGone("connection reset")
        first = asyncio.ensure_future(backend.recover_if_lost(blip, 0))
        await backend.checking.wait()
        others = [asyncio.ensure_future(backend.recover_if_lost(blip, 0)) for _ in range(9)]
        await asyncio.sleep(0)  # each has noted when it failed, and waits for the lock
        backend.release.set()
        return backend, [await first, *await asyncio.gather(*others)]

    backend, answers = asyncio.run(main())
    assert answers == [False] * 10 and backend.checks == 2

"""How the server ends (artcloud/server/lifecycle.py): one task on the server's loop, in-process here. What ends
it (the lease, --max-duration, the parent's death, a preemption notice, a signal), that the final pushes run at
once (D3), on the monotonic clock (D11), with one force-exit timer; and `artcloud serve`'s exit status (D14).
The same paths through a real server process: test_lease.py, test_shutdown.py."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from artcloud.server import lifecycle as lifecycle_module
from artcloud.server.lease import Lease
from artcloud.server.lifecycle import Lifecycle


class HeldPush:
    """A model whose final push (and close, which pushes) returns only once `n` pushes have begun: pushed one
    after another, the first would wait forever."""

    def __init__(self, name: str, begun: list[str], all_begun: asyncio.Event, n: int):
        self.name, self.begun, self.all_begun, self.n = name, begun, all_begun, n
        self.busy, self.frozen = False, False

    async def final_push(self) -> str | None:
        self.begun.append(self.name)
        if len(self.begun) == self.n:
            self.all_begun.set()
        await self.all_begun.wait()
        return None if self.name != "b" else "TimedOut: b did not finish"

    close = final_push

    async def freeze(self) -> None:
        self.frozen = True

    def info(self) -> dict:
        return {"name": self.name}


@pytest.mark.parametrize("path", ["shutdown", "lifespan_exit"])
def test_final_pushes_of_every_model_run_at_once(path):
    """D3: POST /artcloud/shutdown and the lifespan exit (lease, signal) push all models together, so one
    FINAL_PUSH_DEADLINE_S bounds them all (before: one after another, each with the whole bound)."""

    async def main():
        begun: list[str] = []
        all_begun = asyncio.Event()
        trainers = [HeldPush(n, begun, all_begun, 4) for n in ("a", "b", "c")]
        lifecycle = Lifecycle(lambda: trainers, lambda: [HeldPush("history", begun, all_begun, 4)])
        if path == "shutdown":
            answer = await asyncio.wait_for(lifecycle.shutdown(), 10)
            assert answer == [{"name": "a", "training": False}, {"name": "b", "training": False,
                                                                 "error": "TimedOut: b did not finish"},
                              {"name": "c", "training": False},
                              {"name": "history", "training": False}]  # a prompted model's too (code review 3, R7)
            assert all(t.frozen for t in trainers) and lifecycle.stopping
        else:
            await asyncio.wait_for(lifecycle.push_all(close=True), 10)
        assert sorted(begun) == ["a", "b", "c", "history"]

    asyncio.run(main())


def test_the_final_push_deadline_is_the_pushers_bound_and_defined_once():
    import inspect

    from artcloud import wire
    from artcloud.server import pusher

    assert wire.FINAL_PUSH_DEADLINE_S == 600.0
    assert inspect.signature(pusher.Pusher.flush).parameters["timeout"].default == wire.FINAL_PUSH_DEADLINE_S
    assert not hasattr(pusher, "FLUSH_TIMEOUT_S")


def run_until_it_ends(lifecycle: Lifecycle, timeout: float = 10) -> None:
    asyncio.run(asyncio.wait_for(lifecycle.run(tick_s=0.01), timeout))
    assert lifecycle.draining


def test_the_lease_holds_while_renewed_and_ends_the_server_after_it(caplog):
    lease = Lease(lease_s=0.3)
    lifecycle = Lifecycle(lambda: (), lease=lease)

    async def main():
        task = asyncio.create_task(lifecycle.run(tick_s=0.01))
        held_until = time.monotonic() + 1.0  # three leases, renewed all along
        while time.monotonic() < held_until:
            lease.touch()
            await asyncio.sleep(0.05)
        assert not lifecycle.draining and not task.done()
        last = lease.last_request_at
        await asyncio.wait_for(task, 5)
        return time.monotonic() - last

    with caplog.at_level(logging.WARNING, "artcloud.server"):
        idle = asyncio.run(main())
    assert lifecycle.draining and idle >= 0.3
    assert "no client request or heartbeat for " in caplog.text and ": pushing checkpoints and shutting down" in caplog.text


def test_max_duration_ends_the_server_however_busy_and_the_lease_ignores_the_wall_clock(monkeypatch, caplog):
    """D11: a wall-clock step (NTP on a fresh VM) neither ends a lease early nor stretches it."""
    lease = Lease(lease_s=60, max_duration_s=3600)
    monkeypatch.setattr(time, "time", lambda: 1e12)  # the wall clock jumps ~30,000 years ahead
    assert lease.ended() is None
    info = lease.info()
    assert info["idle_s"] < 5 and info["uptime_s"] < 5
    lease = Lease(max_duration_s=0.2)
    with lease.request("/artcloud/models"), caplog.at_level(logging.WARNING, "artcloud.server"):  # a request in flight
        run_until_it_ends(Lifecycle(lambda: (), lease=lease))
    assert "reached --max-duration " in caplog.text and ": pushing checkpoints and shutting down" in caplog.text


def test_the_parents_death_ends_the_server(caplog):
    lifecycle = Lifecycle(lambda: ())
    lifecycle.parent_pid = -1  # not our parent: as after the parent died and we were reparented
    with caplog.at_level(logging.WARNING, "artcloud.server"):
        run_until_it_ends(lifecycle)
    assert "parent process -1 is gone: shutting down" in caplog.text


def test_a_preemption_notice_ends_the_server(caplog):
    class Notices:  # preemption.Watch's face: the third poll brings the notice
        polls = 0

        async def start(self) -> None:
            pass

        async def notice(self) -> str | None:
            self.polls += 1
            return "AWS spot instance-action" if self.polls == 3 else None

    lifecycle = Lifecycle(lambda: ())
    lifecycle.preemption = Notices()
    with caplog.at_level(logging.WARNING, "artcloud.server"):
        run_until_it_ends(lifecycle)
    assert "preemption notice (AWS spot instance-action): pushing the last checkpoints and exiting" in caplog.text


def test_a_signal_drains_and_one_timer_forces_the_exit_when_the_graceful_path_hangs(monkeypatch, caplog):
    forced: list[float] = []
    monkeypatch.setattr(lifecycle_module, "_force_exit", forced.append)
    server = SimpleNamespace(should_exit=True)  # uvicorn's signal handler set it; its graceful path then hangs
    lifecycle = Lifecycle(lambda: ())
    lifecycle.server, lifecycle.force_after_s = server, 0.05
    with caplog.at_level(logging.WARNING, "artcloud.server"):
        run_until_it_ends(lifecycle)
        lifecycle.end("a second reason")  # ignored: one way out, one timer
    assert "asked to stop (a signal)" in caplog.text and "a second reason" not in caplog.text
    deadline = time.monotonic() + 10
    while not forced:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)
    assert forced == [0.05]


def test_serve_exits_1_when_its_lifespan_exit_fails(tmp_path):
    """D14: the exit status says the graceful exit failed (before: 0 whatever happened)."""
    script = (
        "import sys\n"
        "from artcloud.server.registry import Registry\n"
        "async def close(self):\n"
        "    raise RuntimeError('the final pushes could not run')\n"
        "Registry.close = close\n"
        "from artcloud.cli import main\n"
        f"sys.argv = ['artcloud', 'serve', '--path', {str(tmp_path / 'd')!r}, '--port', '0', '--max-duration', '1s']\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "reached --max-duration 1s" in done.stderr and "the final pushes could not run" in done.stderr


def test_a_retention_run_started_by_a_push_is_kept_until_it_ends(tmp_path):
    """D10: the loop holds tasks weakly; a retention task that nothing else refers to must not be collected."""
    import gc
    import weakref

    from artcloud.server.training import ModelTrainer

    model = SimpleNamespace(name="m", spec=SimpleNamespace(project="p"), folder=tmp_path)
    trainer = ModelTrainer(model)  # type: ignore[arg-type]
    alive: list[weakref.ref] = []

    async def retain() -> None:  # waits on a future that only its own frame refers to
        waiting = asyncio.get_running_loop().create_future()
        alive.append(weakref.ref(waiting))
        await waiting

    async def main():
        trainer._retain = retain
        trainer._pushed(1)
        await asyncio.sleep(0)
        gc.collect()
        assert alive[0]() is not None, "the retention task was collected mid-run"
        for task in trainer._tasks:
            task.cancel()

    asyncio.run(main())


def test_a_prompted_model_whose_final_push_failed_still_gives_its_claim_up(tmp_path):
    """Code review 3, R7: its claim was kept to time out, and the next server's register was a 409 `model_locked`
    for 15 min, for a model nobody trains. The failed push is in the shutdown's answer instead."""
    from artcloud.server.prompted import PromptedModel
    from artcloud.wire import RegisterRequest

    class Pusher:  # the pusher's two calls close makes, the push failing as S3 down makes it
        def __init__(self):
            self.calls = []

        async def final_push(self):
            self.calls.append("final_push")
            return "EndpointConnectionError: S3 is down"

        async def release(self):
            self.calls.append("release")

    pusher = Pusher()
    model = PromptedModel(RegisterRequest(name="judge", project="p", base_model=None), tmp_path, pusher)
    asyncio.run(model.close())
    assert pusher.calls == ["final_push", "release"]

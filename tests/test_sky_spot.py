"""Spot machines: preempted mid-run, replaced, and training goes on from S3 with no step lost or trained twice.

The stand-in (tests/sky_standin.py) preempts a cluster as a cloud does: the notice on the node's metadata service
(tests/sky_metadata.py, AWS's IMDSv2 shape), then, a while later, the machine terminated. Everything else is real:
the server watching the notice and pushing its last checkpoint to SeaweedFS, SkyBackend launching a new cluster,
the new server resuming from S3, the model registered again, and the user's own OpenAI client and train loop
carrying on.
"""

from __future__ import annotations

import asyncio
import io
import logging
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

import artcloud
from artcloud.backends.sky import SkyBackend
from artcloud.backends.state import StateDir
from artcloud.storage.s3 import CheckpointStore, S3Config
from tests.helpers import gather_groups, wait_for
from tests.sky_standin import LocalSky, cluster_pids
from tests.test_sky import TINY, use_s3

HOLD_STEP = """
import os, pathlib, time
try:
    from artcloud.server.engines import engine as _engine
except ImportError:  # the node's own pythons, before the wheel is installed
    _engine = None
if _engine is not None:
    _train_step, _dir = _engine.Engine.train_step, pathlib.Path(os.environ["HOLD_STEP_DIR"])

    def train_step(self, *args, **kwargs):
        if (_dir / "hold").exists():
            (_dir / "in-step").touch()
            while (_dir / "hold").exists():
                time.sleep(0.05)
        return _train_step(self, *args, **kwargs)

    _engine.Engine.train_step = train_step

    # And while HOLD_STEP_DIR/hold-exit exists, a server that stopped serving (its port closed) does not exit.
    import asyncio
    from artcloud.server.registry import Registry

    _close = Registry.close

    async def close(self):
        if (_dir / "hold-exit").exists():
            (_dir / "at-exit").touch()
            while (_dir / "hold-exit").exists():
                await asyncio.sleep(0.05)
        return await _close(self)

    Registry.close = close
"""


def hold_step(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """HOLD_STEP for a server: the environment that loads it (PYTHONPATH, HOLD_STEP_DIR) and its folder, where `hold`
    holds a training step in the engine (`in-step` says one is held) and `hold-exit` a server's exit."""
    hook, hold = tmp_path / "hook", tmp_path / "hold"
    hook.mkdir(), hold.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_STEP)
    return {"PYTHONPATH": str(hook), "HOLD_STEP_DIR": str(hold)}, hold


def _preempt_soon(name: str, *, notice_s: float) -> threading.Thread:
    thread = threading.Thread(target=LocalSky().preempt, args=(name,), kwargs={"notice_s": notice_s}, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_preempted_spot_machine_is_replaced_and_training_goes_on(sky_env, monkeypatch, seaweed, caplog, tmp_path):
    caplog.set_level(logging.WARNING)
    s3 = use_s3(monkeypatch, seaweed, "spot")
    store = CheckpointStore(S3Config.from_uri(s3))
    # Each new machine installs for a few seconds, its /health answered by bootstrap_health.py meanwhile:
    # requests in flight must wait for the replacement, not reach that responder.
    monkeypatch.setenv("ARTCLOUD_STANDIN_INSTALL_DELAY_S", "3")

    # On the cluster (its PYTHONPATH): a training step waits in the engine while HOLD_STEP_DIR/hold exists, so the
    # machine is taken in the middle of one on every run, however fast the step (it used to finish first, now and then).
    hook_env, hold = hold_step(tmp_path)

    async def main() -> SkyBackend:
        backend = SkyBackend(gpu="H100:1", use_spot=True, cluster_name="spot", s3=s3, idle_minutes=1, env=hook_env)
        assert backend.relaunch_on_loss
        async with backend:
            model = artcloud.TrainableModel(name="agent", project="spot", base_model=TINY,
                                            lora=artcloud.LoraConfig(rank=4))
            await model.register(backend)
            client = model.openai_client()  # made once: it must follow the backend to the new machine
            screen = io.StringIO()  # a terminal: a replacement draws no launch bar over model.train's
            backend.progress_console = Console(file=screen, force_terminal=True, width=120)

            async def groups():
                return await gather_groups(model, client)

            step1 = await model.train(await groups(), config=artcloud.TrainConfig(learning_rate=1e-3), progress=False)
            assert step1.step == 1
            model.merge_state({"offset": 1})  # ART's state: it must come back with the step on every new machine

            # 1. The cloud's notice while the loop gathers rollouts: the server pushes and exits; the next
            #    request finds it gone, the backend brings up a new machine, and the same client goes on.
            #    The old server is held between closing its port and exiting (hold-exit) until a refused request
            #    has made the client find it going: that request must wait for the replacement, not fail.
            (hold / "hold-exit").touch()
            seen_going = asyncio.Event()
            going = backend.provisioner.going

            async def watched_going() -> bool:
                answer = await going()
                if answer:
                    seen_going.set()
                return answer

            backend.provisioner.going = watched_going

            async def release_exit() -> None:
                await seen_going.wait()
                while not (hold / "at-exit").exists():
                    await asyncio.sleep(0.1)
                (hold / "hold-exit").unlink()

            releaser = asyncio.create_task(release_exit())
            preemption = _preempt_soon("spot", notice_s=60)
            while not any("preemption notice (" in line for line in backend.provisioner.log_tail(400)):
                await asyncio.sleep(0.5)
            # The server answers until its push is done and it exits: the loop gathers on until a request finds
            # it gone. (One gather used to be enough under load; on a quiet machine it could end first.)
            deadline = time.monotonic() + 120
            batch = await groups()
            while not backend.replacements:
                assert time.monotonic() < deadline, "the server was still answering 2 minutes after the notice"
                batch = await groups()
            # (the new machine may get the old one's port back: the URL proves nothing, the replacement does)
            assert len(backend.replacements) == 1 and releaser.done()
            preemption.join(timeout=90)
            assert (await backend.model_info("agent")).step == 1  # resumed from S3
            assert model.read_state() == {"offset": 1}
            step2 = await model.train(batch, progress=False)
            assert step2.step == 2 and step2.trained
            model.merge_state({"offset": 2, "epoch": 0})  # written after step 2: it must outlive the next loss too

            # 2. No notice at all, in the middle of a training step: the machine just goes.
            started = asyncio.Event()
            loop = asyncio.get_running_loop()
            original = backend.follow_job

            async def follow(job_id, on_event=None, **kw):
                def seen(event):
                    if event.type == "start":
                        loop.call_soon_threadsafe(started.set)
                    if on_event is not None:
                        on_event(event)
                return await original(job_id, on_event=seen, **kw)

            backend.follow_job = follow
            (hold / "hold").touch()  # the server's next step waits in the engine until the machine is gone
            training = asyncio.ensure_future(model.train(await groups(), progress=False))
            await started.wait()
            await asyncio.to_thread(wait_for, "the step held in the engine", (hold / "in-step").exists, 120)
            await asyncio.to_thread(LocalSky().preempt, "spot", notice_s=0)
            (hold / "hold").unlink()  # the replacement trains the step again, unheld
            step3 = await training
            assert step3.step == 3 and len(backend.replacements) == 2
            assert model.read_state() == {"offset": 2, "epoch": 0}

            history = (await backend.model_info("agent")).history
            assert [h["step"] for h in history] == [1, 2, 3]  # none lost, none trained twice
            assert screen.getvalue() == ""
        return backend

    backend = asyncio.run(main())
    assert store.committed_steps("spot", "agent") == [0, 1, 2, 3]
    lost = backend.replacements
    assert [r["sandbox"] for r in lost] == ["spot", "spot"]
    assert lost[0]["reason"] and lost[0]["price_per_hour"] == 1.25 and lost[0]["cost_usd"] > 0  # local-h100-1 spot
    assert LocalSky().status("spot") is None and cluster_pids(sky_env, "spot") == set()
    assert StateDir().load("spot").state == "down"
    warnings = "\n".join(r.getMessage() for r in caplog.records)
    assert "spot was lost" in warnings and "training resumes from the last checkpoint on S3" in warnings
    assert "NOT pushed" not in warnings  # the last server resumed its step from S3: it is there


def _checkpoint_paths(step: int, *, manifest_only: bool = False):
    """Matches the requests of a push of `step` (its files; or its manifest alone, which the pusher writes last)."""
    def match(request) -> bool:
        path = request.path.split("?")[0]
        if request.method not in ("PUT", "POST") or f"/checkpoints/{step}/" not in path:
            return False
        return path.endswith("/manifest.json") or not manifest_only

    return match


def _latest_pointer(request) -> bool:
    """Matches the write of the LATEST pointer (a push writes it after the step's manifest)."""
    return request.method in ("PUT", "POST") and request.path.split("?")[0].endswith("/LATEST")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_preemption_at_any_phase_loses_no_step_and_trains_none_twice(sky_env, monkeypatch, seaweed, caplog,
                                                                       tmp_path):
    """The machine goes, with no notice, at each phase of a step, each one reached by a barrier on every run:
    1. between steps, step 1's manifest on S3 but not yet the LATEST pointer that follows it (held at the network):
       a rollout request finds it gone, and the new machine resumes from step 1 (committed by its manifest);
    2. inside the train call, before the step is committed (held in the engine before its first gradient step,
       checked not committed): the train call finds it gone and trains the same groups on the new machine;
    3. after the step committed and model.train returned, before any of it reached S3 (its upload held at the
       network): a rollout finds it gone, and the new machine trains that step again from the kept request;
    4. during the push (its files on S3, its manifest held): the train call finds it gone; the step is trained
       again, then the call's own.
    SkyPilot's cached status never sees the loss here (its daemon's minute never comes): only a refresh does."""
    from tests.faults import HTTPFaultProxy

    caplog.set_level(logging.WARNING)
    s3 = use_s3(monkeypatch, seaweed, "phases")
    proxy = HTTPFaultProxy("127.0.0.1", seaweed.port)
    monkeypatch.setenv("ARTCLOUD_S3_ENDPOINT_URL", proxy.endpoint)  # the servers push through the proxy
    monkeypatch.setenv("ARTCLOUD_STANDIN_STATUS_REFRESH_S", "3600")
    store = CheckpointStore(S3Config.from_uri(s3))  # straight to SeaweedFS
    home = sky_env / "clusters" / "spot" / "home"
    # On the machine: a training step waits in the engine while HOLD_STEP_DIR/hold exists.
    hook_env, hold_dir = hold_step(tmp_path)

    def on_s3(step: int) -> bool:
        return step in store.committed_steps("spot", "agent")

    def committed_on_the_machine(step: int) -> bool:
        return (home / "artcloud-data" / "spot" / "agent" / "checkpoints" / str(step) / "manifest.json").exists()

    def go_now() -> None:  # the cloud takes the machine: every process gone at once
        LocalSky().preempt("spot", notice_s=0)

    async def phases(backend: SkyBackend) -> None:
        model = artcloud.TrainableModel(name="agent", project="spot", base_model=TINY,
                                        lora=artcloud.LoraConfig(rank=4))
        await model.register(backend)
        client = model.openai_client()
        config = artcloud.TrainConfig(learning_rate=1e-3)

        async def groups():
            return await gather_groups(model, client)

        await asyncio.to_thread(wait_for, "step 0's LATEST on S3", lambda: store.latest("spot", "agent") == 0, 60)
        held = proxy.hold(_latest_pointer)
        assert (await model.train(await groups(), config=config, progress=False)).step == 1

        # 1. Between steps, step 1's manifest on S3, its LATEST held: the next rollout finds the machine gone.
        assert await asyncio.to_thread(held.arrived.wait, 60), "the push never reached LATEST"
        assert on_s3(1) and store.latest("spot", "agent") == 0
        await asyncio.to_thread(go_now)
        held.release(forward=False)
        batch = await groups()
        assert len(backend.replacements) == 1 and (await backend.model_info("agent")).step == 1
        assert (await model.train(batch, config=config, progress=False)).step == 2

        # 2. Inside the train call of step 3, step 2 on S3: held in the engine before its first gradient step (a
        # barrier on the machine: HOLD_STEP), so that it cannot commit before the machine goes, however slow the
        # client is to hear of it.
        await asyncio.to_thread(wait_for, "step 2 on S3", lambda: on_s3(2), 60)
        (hold_dir / "hold").touch()
        training = asyncio.ensure_future(model.train(await groups(), config=config, progress=False))
        await asyncio.to_thread(wait_for, "step 3 held in the engine", (hold_dir / "in-step").exists, 120)
        assert not committed_on_the_machine(3), "the step committed before the machine went: not phase 2"
        await asyncio.to_thread(go_now)
        (hold_dir / "hold").unlink()  # the new machine trains the step unheld
        assert (await training).step == 3 and len(backend.replacements) == 2

        # 3. Step 4 committed and returned; its upload held before any of it reached S3.
        await asyncio.to_thread(wait_for, "step 3 on S3", lambda: on_s3(3), 60)
        held = proxy.hold(_checkpoint_paths(4))
        assert (await model.train(await groups(), config=config, progress=False)).step == 4
        assert await asyncio.to_thread(held.arrived.wait, 60), "the push never began"
        assert not on_s3(4)
        await asyncio.to_thread(go_now)
        held.release(forward=False)  # the machine that sent it is gone
        batch = await groups()  # finds it gone; the new machine trains step 4 again
        assert len(backend.replacements) == 3 and (await backend.model_info("agent")).step == 4
        assert (await model.train(batch, config=config, progress=False)).step == 5

        # 4. Step 6 committed and returned, step 5 on S3; step 6's files pushed, its manifest held.
        await asyncio.to_thread(wait_for, "step 5 on S3", lambda: on_s3(5), 60)
        held = proxy.hold(_checkpoint_paths(6, manifest_only=True))
        batch = await groups()
        assert (await model.train(batch, config=config, progress=False)).step == 6
        assert await asyncio.to_thread(held.arrived.wait, 60), "the push never began"
        assert not on_s3(6)
        await asyncio.to_thread(go_now)
        held.release(forward=False)
        assert (await model.train(batch, config=config, progress=False)).step == 7  # 6 again, then this one
        assert len(backend.replacements) == 4

        history = (await backend.model_info("agent")).history
        assert [h["step"] for h in history if h.get("source", "train") == "train"] == list(range(1, 8))

    async def main() -> SkyBackend:
        backend = SkyBackend(gpu="H100:1", use_spot=True, cluster_name="spot", s3=s3, idle_minutes=1, env=hook_env)
        async with backend:
            try:
                await phases(backend)
            finally:  # a failed assertion must not leave the last push held until it times out
                for hold in proxy.holds:
                    hold.release(forward=True)
        return backend

    try:
        backend = asyncio.run(main())
    finally:
        proxy.close()
    assert store.committed_steps("spot", "agent")[-1] == 7
    assert [r["sandbox"] for r in backend.replacements] == ["spot"] * 4
    again = [r.getMessage() for r in caplog.records if "was committed on the lost machine" in r.getMessage()]
    assert [m.split("step ")[1].split()[0] for m in again] == ["4", "6"], again  # phases 3 and 4, once each
    assert LocalSky().status("spot", refresh=True) is None and cluster_pids(sky_env, "spot") == set()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_artcloud_run_on_spot_survives_a_preemption_and_counts_it(sky_env, monkeypatch, seaweed, tmp_path):
    """The runner owns the machine and replaces it; the script (examples/ci/train.py, untouched) follows it
    through connection.json. The summary counts the preemption and what the lost machine cost."""
    import json
    import subprocess
    import sys
    import time

    from tests.test_run import TINY_ARGS, TRAIN, s3_steps

    s3 = use_s3(monkeypatch, seaweed, "spot-run")
    monkeypatch.chdir(tmp_path)
    run = subprocess.Popen([sys.executable, "-m", "artcloud", "run", str(TRAIN), "--backend", "sky", "--spot",
                            "--gpu", "H100:1", "--s3", s3, "--name", "spot-run", "--", *TINY_ARGS, "--steps", "12"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while 1 not in s3_steps(seaweed, s3, "nightly", "five-words"):
            assert run.poll() is None, run.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.5)
        LocalSky().preempt("spot-run", notice_s=0)  # no notice: the machine just goes, mid-run
        out, _ = run.communicate(timeout=800)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, out
    summary = json.loads((tmp_path / "artcloud-run.json").read_text())
    assert summary["outcome"] == "succeeded" and summary["models"][0]["step"] == 12
    assert [h["step"] for h in summary["models"][0]["history"]] == list(range(1, 13))  # none lost, none twice
    # Every step the run trained is in the history above; S3 holds the last one. (Not necessarily every step:
    # the pusher pushes the newest committed step when a push ends, so one committed while another uploads
    # may be skipped: its files are in the next, server/pusher.py.)
    pushed = s3_steps(seaweed, s3, "nightly", "five-words")
    assert pushed[-1] == 12 and set(pushed) <= set(range(13)) and pushed == sorted(pushed)
    [lost] = summary["preemptions"]
    assert lost["sandbox"] == "spot-run" and lost["price_per_hour"] == 1.25 and lost["cost_usd"] > 0
    markdown = (tmp_path / "artcloud-run.md").read_text()
    assert "| preemptions | 1 (the run went on on a new machine from the last checkpoint on S3, $" in markdown
    assert "spot-run was lost" in out and "a new machine is up at https://" in out
    assert LocalSky().status("spot-run") is None

"""The client's own races, each phase held on purpose: two registers on a backend that has not started, `artcloud
status` in another terminal while a launch is in progress, and LocalBackend's down."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

import artcloud
from artcloud.backends.sky import SkyBackend
from artcloud.backends.state import StateDir
from tests.sky_standin import ENV_HOLD_LAUNCH, cluster_pids, read_calls
from tests.test_sky import TINY, cli, recording, use_s3


def test_two_models_registering_at_once_launch_one_machine_and_status_meanwhile_leaves_it_be(sky_env, monkeypatch,
                                                                                             tmp_path):
    """The launch is held after SkyPilot was asked and before it knows the cluster (its optimizer at work): both
    registers are in flight then, and `artcloud status` runs. One launch; the record keeps its token and CA."""
    recording(monkeypatch)
    hold = tmp_path / "hold-launch"
    hold.touch()
    monkeypatch.setenv(ENV_HOLD_LAUNCH, str(hold))

    def launches() -> int:
        return sum(c["call"] == "launch" for c in read_calls(sky_env))

    async def main():
        backend = SkyBackend(gpu="H100:1", cluster_name="racing", idle_minutes=1)
        models = [artcloud.TrainableModel(name=n, project="race", base_model=TINY) for n in ("a", "b")]
        both = asyncio.gather(*(m.register(backend) for m in models))
        try:
            while launches() == 0:  # the first launch is held at the stand-in's edge
                assert not both.done(), both.exception()
                await asyncio.sleep(0.05)
            status = await asyncio.to_thread(cli, "status", "--json")
            assert status.returncode == 0, status.stderr
            rows = [json.loads(line) for line in status.stdout.splitlines()]
            assert [(r["name"], r["status"]) for r in rows] == [("racing", "LAUNCHING")]
            assert StateDir().load("racing").state == "launching" and StateDir().credentials("racing") is not None
            # The launch's token and CA wait for its URL: the endpoint changes whole, once the server is ready.
            assert (backend.endpoint.url, backend.endpoint.token) == ("https://pending.invalid", "")
            hold.unlink()
            await asyncio.wait_for(both, 300)
            assert launches() == 1
            record = StateDir().load("racing")
            assert record.state == "up" and StateDir().credentials("racing") == (backend.ca_cert, backend._token)
            assert [(await backend.model_info(n)).name for n in ("a", "b")] == ["a", "b"]
        finally:
            hold.unlink(missing_ok=True)
            await backend.down()

    asyncio.run(main())
    assert cluster_pids(sky_env, "racing") == set() and StateDir().load("racing").state == "down"


def test_a_launch_by_another_live_process_is_not_taken_for_gone(sky_env, monkeypatch):
    """A second process that launches the same name meanwhile is refused in one line, instead of marking the first
    one's record down and launching a second machine under its name."""
    from artcloud.backends.state import SandboxRecord

    state = StateDir()
    parent = {"host": __import__("socket").gethostname(), "pid": __import__("os").getppid()}
    state.save(SandboxRecord(name="busy", provider="sky", launcher=parent), ca_cert="ca", token="t" * 32)
    recording(monkeypatch)
    backend = SkyBackend(name="busy")
    with pytest.raises(artcloud.ArtcloudError) as caught:
        asyncio.run(backend.start())
    error = caught.value
    assert error.code == "name_taken" and f"being launched by process {parent['pid']}" in str(error)
    assert "launch" not in [c["call"] for c in read_calls(sky_env)]
    assert state.load("busy").state == "launching" and state.credentials("busy") == ("ca", "t" * 32)


@pytest.mark.parametrize("how", ["down", "with"])
def test_local_backend_down_asks_for_the_final_push_and_says_what_s3_holds(seaweed, monkeypatch, tmp_path, caplog, how):
    """LocalBackend.down() sent SIGTERM (SIGKILL 30 s later) and never asked: no verdict, and a push cut short. So did
    leaving ART's `with LocalBackend() as backend:` (code review 3, F8), where the steps ran in asyncio.run()s of
    their own: it does what down() does."""
    s3 = use_s3(monkeypatch, seaweed, f"local-{how}")
    caplog.set_level(logging.INFO, "artcloud.client")

    async def train(backend):
        model = artcloud.TrainableModel(name="agent", project="down", base_model=TINY)
        await model.register(backend)
        from tests.helpers import gather_groups

        groups = await gather_groups(model, n=4, max_tokens=6)
        assert (await model.train(groups, progress=False)).step == 1

    async def main():
        backend = artcloud.LocalBackend(tmp_path / "srv", s3=s3)
        await train(backend)
        await backend.down()
        return backend

    if how == "down":
        backend = asyncio.run(main())
    else:
        with artcloud.LocalBackend(tmp_path / "srv", s3=s3) as backend:
            asyncio.run(train(backend))
    assert not backend.running
    assert "last checkpoint pushed (agent@1)" in caplog.text
    from artcloud.storage.s3 import CheckpointStore, S3Config

    assert CheckpointStore(S3Config.from_uri(s3)).latest("down", "agent") == 1


def test_two_processes_writing_one_record_at_once_both_land_whole(tmp_path, monkeypatch):
    """Both writers hold their temporary file when they rename it (a barrier in os.replace): with one fixed temporary
    name the second truncated the first's file and then found it renamed away."""
    import os
    import threading

    from artcloud.backends import state as state_module
    from artcloud.backends.state import SandboxRecord

    state = StateDir(tmp_path / "st")
    state.save(SandboxRecord(name="box", provider="sky"))
    both_written = threading.Barrier(2, timeout=10)
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith("sandbox.json"):
            both_written.wait()
        real_replace(src, dst)

    monkeypatch.setattr(state_module.os, "replace", replace)
    errors: list[BaseException] = []

    def write(gpu: str) -> None:
        try:
            state.save(SandboxRecord(name="box", provider="sky", gpu=gpu))
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    writers = [threading.Thread(target=write, args=(g,)) for g in ("A100:1", "H100:8")]
    for w in writers:
        w.start()
    for w in writers:
        w.join(20)
    assert errors == []
    assert state.load("box").gpu in ("A100:1", "H100:8")
    assert [p.name for p in (tmp_path / "st" / "sandboxes" / "box").iterdir() if p.name.endswith(".tmp")] == []

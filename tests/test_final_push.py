"""Final pushes are checked, not assumed (issue 14, point 8): `artcloud down` says per model whether S3
holds its newest step, and exits 6 when it does not (after tearing down anyway).

The sandboxes run on the SkyPilot stand-in (tests/sky_standin.py: the real wheel, the real `artcloud
serve`); S3 is a real SeaweedFS. The push that fails does so for real: the sandbox's own SeaweedFS is
stopped after the model's first push, before the step that then cannot reach it.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

import artcloud
from artcloud.backends.client import push_verdicts
from artcloud.wire import ShutdownAnswer
from tests.seaweed import SeaweedS3
from tests.sky_standin import leftover_processes
from tests.test_modal import one_step
from tests.test_run import s3_steps
from tests.test_sky import use_s3


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "artcloud", *args], capture_output=True, text=True, timeout=timeout)


async def launch_and_train(name: str, s3: str, before_training=None) -> int:
    """Launch a sandbox, register `agent` (its step 0 reaches S3), call `before_training()`, train one
    step, and leave the sandbox up (as a laptop closing its lid)."""
    from artcloud.backends.sky import SkyBackend

    backend = SkyBackend(cluster_name=name, gpu="H100:1", s3=s3, idle_minutes=5)
    await backend.start()
    try:
        model = artcloud.TrainableModel(name="agent", project="modal", base_model="artcloud/tiny-random",
                                        lora=artcloud.LoraConfig(rank=4))  # as one_step registers it
        await model.register(backend)
        deadline = time.monotonic() + 60
        while getattr((await backend.model_info("agent")).s3, "pushed_step", None) != 0:
            assert time.monotonic() < deadline, "step 0 never reached S3"
            await asyncio.sleep(0.2)
        if before_training is not None:
            await asyncio.to_thread(before_training)
        return (await one_step(backend, "agent")).step
    finally:
        await backend.close()


@pytest.mark.slow
def test_down_confirms_a_push_that_landed_and_exits_6_for_one_that_did_not(sky_env, monkeypatch, seaweed, tmp_path):  # noqa: F811
    good_s3 = use_s3(monkeypatch, seaweed, "final-push-good")
    assert asyncio.run(launch_and_train("good", good_s3)) == 1
    down = cli("down", "good")
    assert down.returncode == 0, down.stderr
    assert down.stdout.splitlines() == ["good: last checkpoint pushed (agent@1)", "good: torn down"]
    assert s3_steps(seaweed, good_s3, "modal", "agent")[-1] == 1

    own = SeaweedS3(tmp_path / "own-s3").start()  # this sandbox's S3 alone: stopping it touches no other test
    try:
        bad_s3 = use_s3(monkeypatch, own, "final-push-bad")
        monkeypatch.setenv("ARTCLOUD_S3_ATTEMPTS", "2")  # the sandbox's too: the same verdict, a minute sooner
        assert asyncio.run(launch_and_train("bad", bad_s3, before_training=own.stop)) == 1
        started = time.monotonic()
        down = cli("down", "bad")
        took = time.monotonic() - started
    finally:
        own.stop()
    assert down.returncode == 6, (down.stdout, down.stderr)
    lines = down.stdout.splitlines()
    assert len(lines) == 2 and lines[1] == "bad: torn down", down.stdout  # torn down anyway
    assert lines[0].startswith("bad: last checkpoint NOT pushed (agent@1): ") and lines[0].endswith(
        "; the newest step on S3 is 0"), lines[0]
    errors = down.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("artcloud: error: the final push was not confirmed for bad/agent@1"), \
        down.stderr
    assert took < 11 * 60  # the client waited for the server's verdict, within its own bound
    assert leftover_processes(sky_env) == {}


def test_push_verdicts_judge_each_model_of_a_shutdown_answer():
    s3 = {"uri": "s3://b/p", "pending": False, "last_error": None, "pushed_bytes": 0, "errors": 0}

    def model(name: str, step: int, **rest) -> dict:  # a shutdown answer's entry, the fields every one has
        return {"name": name, "step": step, "project": "p", "base_model": "m", "lora": {}, "served_as": f"{name}@{step}",
                "temperature": 1.0, "training": False, "checkpoints": [step], "history": [], **rest}

    answer = ShutdownAnswer.model_validate({"ok": True, "models": [
        model("safe", 3, s3={**s3, "pushed_step": 3}),
        model("behind", 3, s3={**s3, "pushed_step": 2}),
        model("failed", 2, s3={**s3, "pushed_step": 1, "last_error": "EndpointConnectionError: refused\nmore"},
              error="RuntimeError: the push of failed failed 3 times"),
        model("erred", 2, s3={**s3, "pushed_step": 1, "last_error": "EndpointConnectionError: refused\nmore"}),
        model("running", 4, s3={**s3, "pushed_step": 4, "pending": True}),
        model("never", 0, s3={**s3, "pushed_step": None}),
        model("local", 5, s3=None, training=True),
        # Prompted models (code review 3, R7: they were in no answer): their history is what is pushed.
        {"name": "judge", "project": "p", "base_model": None, "prompted": True, "step": 0, "history": [],
         "s3": {**s3, "pushed_step": None}},
        {"name": "critic", "project": "p", "base_model": None, "prompted": True, "step": 0, "history": [],
         "s3": {**s3, "pushed_step": None}, "error": "EndpointConnectionError: refused\nmore"},
    ]})
    lines = {v.name: (v.status, v.line(on_sandbox=True)) for v in push_verdicts(answer)}
    assert lines == {
        "safe": ("pushed", "last checkpoint pushed (safe@3)"),
        "behind": ("not_pushed", "last checkpoint NOT pushed (behind@3): S3 has step 2, not 3; the newest step on S3 is 2"),
        "failed": ("not_pushed", "last checkpoint NOT pushed (failed@2): the final push failed: RuntimeError: the push of "
                                 "failed failed 3 times; the newest step on S3 is 1"),
        "erred": ("not_pushed", "last checkpoint NOT pushed (erred@2): S3 error: EndpointConnectionError: refused; "
                                "the newest step on S3 is 1"),
        "running": ("not_pushed", "last checkpoint NOT pushed (running@4): a push was still running; the newest step on S3 is 4"),
        "never": ("not_pushed", "last checkpoint NOT pushed (never@0): no step of it reached S3; nothing of it is on S3"),
        "local": ("no_s3", "no S3 for local@5: its checkpoints stayed on the server's disk and go with the sandbox; "
                           "a training step in flight was dropped"),
        "judge": ("pushed", "history pushed (judge)"),
        "critic": ("not_pushed", "history NOT pushed (critic): EndpointConnectionError: refused"),
    }


@pytest.mark.slow
def test_sandbox_down_logs_where_the_checkpoints_are_left(sky_env, caplog):  # noqa: F811
    """`await backend.down()` judges the final push too: without S3 it warns that the checkpoints go
    with the sandbox."""
    import logging

    from artcloud.backends.sky import SkyBackend

    async def main():
        backend = SkyBackend(cluster_name="nos3", gpu="H100:1", idle_minutes=5)
        await backend.start()
        try:
            model = artcloud.TrainableModel(name="agent", project="sky", base_model="artcloud/tiny-random")
            await model.register(backend)
        finally:
            with caplog.at_level(logging.INFO, logger="artcloud.client"):
                await backend.down()
        return backend

    backend = asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "artcloud.client"]
    assert warnings == ["nos3: no S3 for agent@0: its checkpoints stayed on the server's disk and go with the sandbox"]
    assert backend.api.status("nos3") is None and leftover_processes(sky_env) == {}

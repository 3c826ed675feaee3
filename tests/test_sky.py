"""SkyBackend and `artcloud launch/status/logs/down`, with the stand-in at SkyPilot's edge.

tests/sky_standin.py runs the generated task's own setup (pip installs this artcloud's wheel into a fresh
venv) and run (`artcloud serve` over HTTPS) as local processes on loopback; everything on this side of the
seam is the real code. Bad-input paths use RecordingSky, which also logs every call it gets.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import artcloud
from artcloud.backends.sky import SkyBackend, SkyError
from artcloud.backends.state import StateDir
from tests.helpers import find_python, gather_groups
from tests.seaweed import ACCESS_KEY, SECRET_KEY
from tests.sky_standin import cluster_pids, read_calls

TINY = "artcloud/tiny-random"
REPO = Path(__file__).resolve().parents[1]


def recording(monkeypatch, fault: str | None = None) -> None:
    monkeypatch.setenv("ARTCLOUD_SKY_API", "tests.sky_standin:RecordingSky")
    if fault:
        monkeypatch.setenv("ARTCLOUD_STANDIN_FAULT", fault)


def calls(root: Path) -> list[str]:
    return [c["call"] for c in read_calls(root)]


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "artcloud", *args], capture_output=True, text=True, timeout=timeout)


def use_s3(monkeypatch, seaweed, bucket: str) -> str:
    """Credentials as a laptop has them: in its environment (SkyBackend ships them as secrets)."""
    monkeypatch.setenv("ARTCLOUD_S3_ENDPOINT_URL", seaweed.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    seaweed.client().create_bucket(Bucket=bucket)
    return f"s3://{bucket}/runs"


# ----------------------------------------------------------------------------------------- bad input


def test_unknown_gpu_launches_nothing(sky_env, monkeypatch):
    recording(monkeypatch)
    with pytest.raises(SkyError, match=r"no GPU named 'H1000'.*sky show-gpus") as e:
        asyncio.run(SkyBackend(gpu="H1000:1").start())
    assert e.value.field == "gpu"
    assert "launch" not in calls(sky_env) and StateDir().all() == []


def test_gpu_count_that_no_machine_has(sky_env, monkeypatch):
    recording(monkeypatch)
    with pytest.raises(SkyError, match=r"no machine has 3x H100: choose a count among"):
        asyncio.run(SkyBackend(gpu="H100:3").start())
    assert "launch" not in calls(sky_env)


def test_cloud_not_enabled_passes_sky_check_on(sky_env, monkeypatch):
    recording(monkeypatch)
    with pytest.raises(SkyError, match=r"aws is not enabled in SkyPilot: AWS: credentials not found.*sky check aws"):
        asyncio.run(SkyBackend(cloud="aws").start())
    assert "launch" not in calls(sky_env) and StateDir().all() == []


def test_s3_without_credentials_launches_nothing(sky_env, monkeypatch):
    recording(monkeypatch)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(sky_env.parent / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(sky_env.parent / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(SkyError, match=r"no S3 credentials on this machine for s3://b/p: set ARTCLOUD_S3_ACCESS_KEY_ID") as e:
        asyncio.run(SkyBackend(s3="s3://b/p").start())
    assert e.value.field == "s3" and "launch" not in calls(sky_env)


def test_bad_arguments_are_caught_before_anything_runs():
    with pytest.raises(ValueError, match="NAME:COUNT"):
        SkyBackend(gpu="H100:x")
    with pytest.raises(ValueError, match="region= needs cloud="):
        SkyBackend(region="us-east-1")
    with pytest.raises(ValueError, match="docker:"):
        SkyBackend(image="nvcr.io/x:1")
    with pytest.raises(ValueError, match="lease 'soon' is not a duration"):
        SkyBackend(lease="soon")
    with pytest.raises(ValueError, match="must start with a letter"):
        SkyBackend(cluster_name="My_Cluster")


def test_missing_user_secret_names_the_variable(sky_env, monkeypatch):
    recording(monkeypatch)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(SkyError, match="secret WANDB_API_KEY is not set in this environment: export WANDB_API_KEY"):
        asyncio.run(SkyBackend(secrets=["WANDB_API_KEY"]).start())
    assert "launch" not in calls(sky_env)


def test_launch_failure_tears_down_and_says_why(sky_env, monkeypatch):
    recording(monkeypatch, "launch_fails")
    backend = SkyBackend(gpu="H100:1", cluster_name="failing")
    with pytest.raises(SkyError, match=r"SkyPilot could not launch failing: .*torn down") as e:
        asyncio.run(backend.start())
    assert e.value.code == "launch_failed"
    assert calls(sky_env)[-1] == "down"
    assert StateDir().load("failing").state == "down" and StateDir().credentials("failing") is None


def test_a_failing_server_job_fails_fast_with_its_logs(sky_env, monkeypatch):
    recording(monkeypatch, "job_fails")
    started = time.monotonic()
    with pytest.raises(SkyError, match=r"(?s)ended \(FAILED\).*boom.*torn down"):
        asyncio.run(SkyBackend(cluster_name="boom", startup_timeout="5m").start())
    assert time.monotonic() - started < 120  # not the startup timeout
    assert "down" in calls(sky_env)


def test_a_failed_install_is_a_launch_failure_with_the_setups_last_lines(sky_env, monkeypatch):
    """SkyPilot 0.14 runs the setup inside the job, after `launch` returned (execution.py:924). A node whose
    python3 is 3.10 (Ubuntu 22.04), its venv forced onto it: resolving the gpu lock finds no solution there. That is
    a failed launch, said with uv's own lines, and the cluster is torn down (not left to autodown)."""
    monkeypatch.setenv("ARTCLOUD_STANDIN_PYTHON", find_python("3.10"))
    backend = SkyBackend(gpu="L4:1", cluster_name="u22", env={"ARTCLOUD_PYTHON": ">=3.10"}, startup_timeout="5m")
    started = time.monotonic()
    with pytest.raises(SkyError) as e:
        asyncio.run(backend.start())
    message = str(e.value)
    assert e.value.code == "setup_failed"
    assert message.startswith("could not launch u22: installing artcloud on it failed (SkyPilot job FAILED_SETUP)")
    assert "No solution found when resolving dependencies" in message and "torn down" in message, message
    assert time.monotonic() - started < 120  # at once, not at startup_timeout
    assert backend.api.status("u22", refresh=True) is None and StateDir().load("u22").state == "down"


def test_the_install_counts_against_startup_timeout(sky_env, monkeypatch):
    """The install runs after `launch` returned: startup_timeout bounds it, with the server's start."""
    monkeypatch.setenv("ARTCLOUD_STANDIN_INSTALL_DELAY_S", "600")  # each of the node's `uv pip install` waits
    backend = SkyBackend(gpu="L4:1", cluster_name="slow", startup_timeout="6s")
    with pytest.raises(SkyError, match=r"not ready in time \(startup_timeout 6s\).*torn down") as e:
        asyncio.run(backend.start())
    assert e.value.code == "startup_timeout"
    assert backend.api.status("slow", refresh=True) is None and cluster_pids(sky_env, "slow") == set()


def test_health_that_never_comes_times_out_and_tears_down(sky_env, monkeypatch):
    recording(monkeypatch, "no_health")
    with pytest.raises(SkyError, match=r"not ready in time \(startup_timeout 4s\).*torn down") as e:
        asyncio.run(SkyBackend(cluster_name="silent", startup_timeout="4s").start())
    assert e.value.code == "startup_timeout"
    assert "down" in calls(sky_env) and cluster_pids(sky_env, "silent") == set()


def test_keep_true_leaves_a_failed_start_up_for_debugging(sky_env, monkeypatch):
    recording(monkeypatch, "no_health")
    backend = SkyBackend(cluster_name="kept", startup_timeout="3s", keep=True)
    with pytest.raises(SkyError, match="kept up: `artcloud logs kept`"):
        asyncio.run(backend.start())
    assert "down" not in calls(sky_env) and backend.api.status("kept") is not None
    result = cli("down", "kept")
    assert result.returncode == 0 and "kept: torn down" in result.stdout
    assert backend.api.status("kept") is None


def test_cluster_name_taken_by_another_cluster(sky_env, monkeypatch):
    recording(monkeypatch)
    api = SkyBackend().api
    api.launch({"name": "theirs", "resources": {}, "run": "sleep 600"}, secrets={}, cluster_name="theirs", idle_minutes=None)
    try:
        with pytest.raises(SkyError, match=r"cluster named 'theirs' exists, but artcloud did not launch it") as e:
            asyncio.run(SkyBackend(cluster_name="theirs").start())
        assert e.value.field == "cluster_name"
        result = cli("down", "theirs")
        assert result.returncode == 2 and result.stderr.count("\n") == 1
        assert "launched no sandbox named 'theirs'" in result.stderr
        assert api.status("theirs") is not None  # someone else's cluster is never touched
        down_calls = [c for c in calls(sky_env) if c == "down"]
        assert down_calls == []
    finally:
        api.down("theirs")


def test_cli_errors_are_one_line_and_exit_2(sky_env):
    for args, expected in [
        (["down", "nope"], "this machine launched no sandbox named 'nope': `artcloud status` lists them"),
        (["down"], "name the sandboxes to tear down"),
        (["logs", "nope"], "no sandbox named 'nope'"),
        (["launch", "--gpu", "H1000"], "no GPU named 'H1000'"),
        (["launch", "--lease", "soon"], "lease 'soon' is not a duration"),
        (["launch", "--env", "NOEQUALS"], "--env takes KEY=VALUE"),
    ]:
        result = cli(*args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert result.stderr.startswith("artcloud: error: ") and result.stderr.count("\n") == 1, result.stderr
        assert expected in result.stderr, result.stderr
    assert not (sky_env / "clusters").exists() or not any((sky_env / "clusters").iterdir())


def test_dry_run_shows_the_plan_and_a_validated_task_without_secrets(sky_env, monkeypatch):
    monkeypatch.setenv("MY_SECRET", "hunter2-do-not-print")
    result = cli("launch", "--gpu", "H100:1", "--spot", "--name", "plan", "--secret", "MY_SECRET", "--env", "FOO=bar",
                 "--dry-run")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "nothing was launched" in out and "plan" in out and "(spot)" in out
    assert "not by SkyPilot (pip install 'artcloud[sky]')" in out  # this venv has the server, not skypilot:
    # tests/laptop/test_sky_contract.py runs the same dry run where skypilot is installed.
    # The machine SkyPilot would choose among the enabled clouds (only 'local' here), spot, and the most it costs.
    assert "H100:1 (spot) on local local-h100-1 in local, $1.25/h" in out
    assert "at most $10.00 if it runs its whole max_duration (8h00m)" in out
    assert "MY_SECRET: <redacted>" in out and "ARTCLOUD_TOKEN: <redacted>" in out and "FOO: bar" in out
    assert "hunter2" not in out + result.stderr and "BEGIN PRIVATE KEY" not in out
    assert not (sky_env / "clusters").exists() or not any((sky_env / "clusters").iterdir())
    assert StateDir().all() == []


def test_status_with_nothing_launched(sky_env):
    result = cli("status")
    assert result.returncode == 0 and "no live sandboxes" in result.stdout


# ----------------------------------------------------------------------------------------- for real


@pytest.mark.slow
def test_launch_train_checkpoint_to_s3_reconnect_and_down(sky_env, monkeypatch, seaweed):
    s3 = use_s3(monkeypatch, seaweed, "sky-e2e")

    async def main():
        backend = SkyBackend(gpu="H100:1", cluster_name="e2e", s3=s3, idle_minutes=1)
        async with backend:
            assert backend.base_url.startswith("https://127.0.0.1:")
            assert backend._token not in repr(backend)
            model = artcloud.TrainableModel(name="agent", project="sky", base_model=TINY, lora=artcloud.LoraConfig(rank=4))
            await model.register(backend)
            groups = await gather_groups(model, n=4, max_tokens=6)
            result = await model.train(groups, config=artcloud.TrainConfig(learning_rate=1e-3), progress=False)
            assert result.step == 1

            # The registry knows it, with its URL; the CLI shows it.
            record = StateDir().load("e2e")
            assert record.state == "up" and record.url == backend.base_url and record.price_per_hour
            status = cli("status", "--json")
            row = json.loads(status.stdout.splitlines()[0])
            assert row["name"] == "e2e" and row["status"] == "UP" and row["gpu"] == "H100:1" and row["cost_so_far"] > 0
            assert row["resources"] == "1x Local(local-h100-1, {'H100': 1})" and row["price_per_hour"] == 2.49
            logs = cli("logs", "e2e", "--tail", "200")
            assert "serving on https://" in logs.stdout
            assert backend._token not in logs.stdout and "PRIVATE KEY" not in logs.stdout

            # Reconnect: a second backend of that name attaches (no second launch).
            again = SkyBackend(cluster_name="e2e")
            await again.start()
            assert again.base_url == backend.base_url
            assert (await again.model_info("agent")).step == 1
            await again.close()
            assert len(list((sky_env / "clusters").iterdir())) == 1

            # The server pushed step 1 to S3 (the push is in the background: wait for it).
            for _ in range(100):
                info = await backend.model_info("agent")
                if info.s3 is not None and info.s3.pushed_step == 1:
                    break
                await asyncio.sleep(0.2)
            assert info.s3 is not None and info.s3.pushed_step == 1, info.s3
        return backend

    backend = asyncio.run(main())
    assert backend.api.status("e2e") is None
    assert cluster_pids(sky_env, "e2e") == set()
    assert StateDir().load("e2e").state == "down" and StateDir().credentials("e2e") is None
    from artcloud.storage.s3 import CheckpointStore, S3Config

    assert CheckpointStore(S3Config.from_uri(s3)).latest("sky", "agent") == 1
    again = cli("down", "e2e")  # idempotent
    assert again.returncode == 0 and "e2e: already gone" in again.stdout


CLIENT = textwrap.dedent("""
    import asyncio, sys
    import artcloud

    async def main():
        backend = artcloud.SkyBackend(cluster_name="orphan", lease="6s", idle_minutes=1)
        await backend.start()
        model = artcloud.TrainableModel(name="agent", project="sky", base_model="artcloud/tiny-random")
        await model.register(backend)
        client = model.openai_client()
        async def rollout(p):
            messages = [{"role": "user", "content": p}]
            r = await client.chat.completions.create(model="agent", messages=messages, max_tokens=6, logprobs=True)
            c = r.choices[0]
            return artcloud.Trajectory(messages_and_choices=[*messages, c], reward=len(c.message.content or ""))
        groups = await artcloud.gather_trajectory_groups(
            [artcloud.TrajectoryGroup(rollout(p) for _ in range(4)) for p in ("a", "b")], progress=False)
        print("TRAINING", flush=True)
        while True:
            await model.train(groups, progress=False)

    asyncio.run(main())
""")


@pytest.mark.slow
def test_client_killed_mid_training_the_sandbox_goes_by_itself(sky_env, tmp_path):
    """SIGKILL the laptop: the lease ends the server (lease + 10 s at most), then autodown the cluster."""
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    client = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in client.stdout:
            lines.append(line)
            if line.startswith("TRAINING"):
                break
        assert lines and lines[-1].startswith("TRAINING"), "".join(lines)
        time.sleep(1.0)  # inside a training loop now
        client.kill()
        killed_at = time.monotonic()
    finally:
        client.kill()
        client.wait()
    api = SkyBackend().api
    assert api.job_status("orphan", None) == "RUNNING"
    while api.job_status("orphan", None) == "RUNNING" and time.monotonic() - killed_at < 60:
        time.sleep(0.25)
    server_gone_after = time.monotonic() - killed_at
    assert server_gone_after < 6 + 10, server_gone_after
    assert api.job_status("orphan", None) in ("SUCCEEDED", None)  # the server exited cleanly, by itself
    while api.status("orphan") is not None and time.monotonic() - killed_at < 90:
        time.sleep(0.25)
    assert api.status("orphan") is None  # autodown took the cluster
    assert cluster_pids(sky_env, "orphan") == set()
    # `artcloud status` finds it gone and says so.
    result = cli("status")
    assert "no live sandboxes" in result.stdout and "orphan" in result.stdout


@pytest.mark.slow
def test_max_duration_pushes_the_last_checkpoint_and_the_server_goes(sky_env, monkeypatch, seaweed):
    s3 = use_s3(monkeypatch, seaweed, "sky-capped")

    async def main():
        # retries=2: once the server is gone, model_info says so without the default backoff (seconds).
        backend = SkyBackend(cluster_name="capped", s3=s3, max_duration="30s", idle_minutes=1, retries=2)
        await backend.start()
        model = artcloud.TrainableModel(name="capped", project="sky", base_model=TINY)
        await model.register(backend)
        client = model.openai_client()
        messages = [{"role": "user", "content": "hi"}]
        trajectories = []
        for _ in range(4):
            r = await client.chat.completions.create(model="capped", messages=messages, max_tokens=6, logprobs=True)
            trajectories.append(artcloud.Trajectory(messages_and_choices=[*messages, r.choices[0]],
                                                    reward=len(r.choices[0].message.content or "")))
        await model.train([artcloud.TrajectoryGroup(trajectories)], progress=False)
        # Keep the lease alive (heartbeats run): only max_duration can end it.
        deadline = time.monotonic() + 120
        while backend.api.job_status("capped", None) == "RUNNING" and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        with pytest.raises(artcloud.ServerGone):
            await backend.model_info("capped")
        await backend.close()
        return backend

    backend = asyncio.run(main())
    assert backend.api.job_status("capped", None) in ("SUCCEEDED", None)
    from artcloud.storage.s3 import CheckpointStore, S3Config

    assert CheckpointStore(S3Config.from_uri(s3)).latest("sky", "capped") == 1
    asyncio.run(backend.down())
    assert cluster_pids(sky_env, "capped") == set()


@pytest.mark.slow
def test_a_cluster_that_vanishes_mid_training_is_reported_at_once(sky_env):
    """Preemption, or someone's `sky down`: the client says so within seconds, not after minutes of retries."""

    async def main():
        backend = SkyBackend(cluster_name="vanish", idle_minutes=1)
        await backend.start()
        model = artcloud.TrainableModel(name="agent", project="sky", base_model=TINY)
        await model.register(backend)
        client = model.openai_client()
        messages = [{"role": "user", "content": "hi"}]
        trajectories = []
        for _ in range(4):
            r = await client.chat.completions.create(model="agent", messages=messages, max_tokens=6, logprobs=True)
            trajectories.append(artcloud.Trajectory(messages_and_choices=[*messages, r.choices[0]],
                                                    reward=len(r.choices[0].message.content or "")))
        group = artcloud.TrajectoryGroup(trajectories)
        body = {"groups": [group.to_wire()], "config": artcloud.TrainConfig(gradient_steps=64).model_dump(),
                "idempotency_key": "vanish-1"}
        job = await backend.start_train("agent", body)
        assert await asyncio.to_thread(backend.api.down, "vanish")  # the cloud takes the machine away
        started = time.monotonic()
        with pytest.raises(artcloud.ServerGone, match="the cluster vanish is gone .*resumes from the last checkpoint"):
            await backend.follow_job(job.job_id)
        assert time.monotonic() - started < 30
        await backend.down()  # idempotent: nothing left to tear down

    asyncio.run(main())
    assert StateDir().load("vanish").state == "down" and cluster_pids(sky_env, "vanish") == set()

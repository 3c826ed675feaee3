"""`artcloud run` on the cloud backends, with the local stand-ins: the SkyPilot stand-in (runs the task's
setup and run as local processes) and the fake Modal control plane (runs the sandbox's command).

Attached, the runner owns the cluster and tears it down (or says, with exit 5, that it could not). With
--detach the runner exits at once; the loop (`artcloud run --backend local` on the sandbox) trains,
pushes to the real S3, uploads its summary, and the sandbox goes by itself."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.sky_standin import leftover_processes
from tests.test_modal import fake  # noqa: F401  (fixture)
from tests.test_run import TINY_ARGS, TRAIN, assert_pushed_through, s3_steps
from tests.test_sky import recording, use_s3


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "artcloud", *args], capture_output=True, text=True, timeout=timeout)


def wait_for_summary(seaweed, s3: str, name: str, timeout: float = 300) -> dict:
    bucket, _, prefix = s3[5:].partition("/")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            body = seaweed.client().get_object(Bucket=bucket, Key=f"{prefix}/runs/{name}/summary.json")["Body"].read()
            return json.loads(body)
        except Exception:
            time.sleep(1.0)
    raise AssertionError(f"no summary at {s3}/runs/{name}/ after {timeout:.0f} s")


def status_names() -> list[str]:
    result = cli("status", "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert all(row["run"] == "train.py" for row in rows if row["name"].startswith("det-"))
    return [row["name"] for row in rows]


@pytest.mark.slow
def test_run_on_sky_trains_prices_and_tears_the_cluster_down(sky_env, monkeypatch, seaweed, tmp_path):  # noqa: F811
    s3 = use_s3(monkeypatch, seaweed, "attached-sky")
    monkeypatch.chdir(tmp_path)
    result = cli("run", str(TRAIN), "--backend", "sky", "--gpu", "H100:1", "--s3", s3, "--name", "att-sky",
                 "--budget-usd", "50", "--", *TINY_ARGS, "--steps", "2")
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "artcloud-run.json").read_text())
    assert (summary["outcome"], summary["sandbox"], summary["gpu"]) == ("succeeded", "att-sky", "H100:1")
    assert summary["price_per_hour"] > 0 and 0 < summary["estimated_cost_usd"] < 50  # the catalog's price
    assert summary["teardown"] == {"ok": True, "detail": "final checkpoint pushed; att-sky torn down"}
    assert summary["models"][0]["final_checkpoint"] == f"{s3}/nightly/five-words/checkpoints/2"
    assert_pushed_through(seaweed, s3, "nightly", "five-words", 2)
    assert "att-sky" not in status_names() and leftover_processes(sky_env) == {}


def test_run_whose_sandbox_cannot_start_exits_3(sky_env, monkeypatch, seaweed, tmp_path):  # noqa: F811
    recording(monkeypatch, "launch_fails")
    s3 = use_s3(monkeypatch, seaweed, "launch-fails")
    monkeypatch.chdir(tmp_path)
    result = cli("run", str(TRAIN), "--backend", "sky", "--s3", s3, "--name", "nocap")
    assert result.returncode == 3, result.stderr
    summary = json.loads((tmp_path / "artcloud-run.json").read_text())
    assert summary["outcome"] == "launch_failed" and "no capacity in any enabled region" in summary["reason"]
    assert summary["script_exit_code"] is None and summary["teardown"]["ok"]
    assert status_names() == []


@pytest.mark.slow
def test_run_whose_teardown_fails_exits_5_and_names_the_fix(sky_env, monkeypatch, seaweed, tmp_path):  # noqa: F811
    recording(monkeypatch, "down_fails")
    s3 = use_s3(monkeypatch, seaweed, "down-fails")
    monkeypatch.chdir(tmp_path)
    result = cli("run", str(TRAIN), "--backend", "sky", "--s3", s3, "--name", "stuck", "--", *TINY_ARGS, "--steps", "1")
    assert result.returncode == 5, result.stderr
    summary = json.loads((tmp_path / "artcloud-run.json").read_text())
    assert summary["outcome"] == "teardown_failed" and not summary["teardown"]["ok"]
    assert "run `artcloud down stuck`" in summary["reason"]
    assert "stuck" in status_names()  # still listed, so `artcloud down --all` finds it (the fixture downs it)
    assert summary["models"][0]["final_checkpoint"] == f"{s3}/nightly/five-words/checkpoints/1"


@pytest.mark.slow
def test_detach_on_sky_the_runner_exits_and_the_loop_finishes_on_the_cluster(sky_env, monkeypatch, seaweed, tmp_path):  # noqa: F811
    s3 = use_s3(monkeypatch, seaweed, "detached-sky")
    monkeypatch.chdir(tmp_path)
    result = cli("run", str(TRAIN), "--backend", "sky", "--gpu", "H100:1", "--s3", s3, "--name", "det-sky",
                 "--budget-usd", "50", "--detach", "--", *TINY_ARGS, "--steps", "2")
    assert result.returncode == 0, result.stderr
    assert "det-sky is training on its own: `artcloud logs det-sky -f`" in result.stderr
    local = json.loads((tmp_path / "artcloud-run.json").read_text())
    assert local["outcome"] == "detached" and local["detached"] and local["sandbox"] == "det-sky"
    assert f"{s3}/runs/det-sky/summary.md" in local["reason"]
    # The runner came back while the loop was still to run: no summary on S3 yet, the cluster listed.
    bucket, _, prefix = s3[5:].partition("/")
    listed = seaweed.client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/runs/det-sky/")
    assert listed.get("KeyCount", 0) == 0
    assert "det-sky" in status_names()
    follow = subprocess.Popen([sys.executable, "-m", "artcloud", "logs", "det-sky", "-f"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)

    summary = wait_for_summary(seaweed, s3, "det-sky")
    followed, _ = follow.communicate(timeout=120)  # ends with the job
    assert "step 2: mean reward" in followed and "artcloud run: succeeded" in followed
    assert summary["outcome"] == "succeeded" and summary["detached"] and summary["backend"] == "local"
    # The budget travelled with the loop: the catalog's price, counted from the launch.
    assert summary["budget_usd"] == 50 and summary["price_per_hour"] > 0
    (model,) = summary["models"]
    assert model["step"] == 2
    assert_pushed_through(seaweed, s3, "nightly", "five-words", 2)
    assert model["final_checkpoint"] == f"{s3}/nightly/five-words/checkpoints/2"
    markdown = seaweed.client().get_object(Bucket=bucket, Key=f"{prefix}/runs/det-sky/summary.md")["Body"].read().decode()
    assert "succeeded" in markdown

    # The job ended, so autodown takes the cluster (a stand-in minute is 0.5 s); `status` notices.
    deadline = time.monotonic() + 60
    while "det-sky" in status_names() and time.monotonic() < deadline:
        time.sleep(1.0)
    assert "det-sky" not in status_names()
    assert leftover_processes(sky_env) == {}


def test_detach_on_sky_whose_install_fails_is_a_failed_launch_not_detached(sky_env, monkeypatch, seaweed, tmp_path):  # noqa: F811
    """The install runs inside SkyPilot's job, after `launch` returned: the runner waits for the job to run before it
    says "detached", and a failed install (FAILED_SETUP) is a failed launch (exit 3) with the install's lines."""
    recording(monkeypatch, "setup_fails")
    s3 = use_s3(monkeypatch, seaweed, "detached-setup")
    monkeypatch.chdir(tmp_path)
    result = cli("run", str(TRAIN), "--backend", "sky", "--s3", s3, "--name", "det-bad", "--detach")
    assert result.returncode == 3, result.stderr
    assert "training on its own" not in result.stderr
    summary = json.loads((tmp_path / "artcloud-run.json").read_text())
    assert summary["outcome"] == "launch_failed"
    assert "installing artcloud on it failed (SkyPilot job FAILED_SETUP)" in summary["reason"]
    assert "the wheel cannot be installed here" in summary["reason"]
    assert status_names() == [] and leftover_processes(sky_env) == {}


@pytest.mark.slow
def test_detach_on_modal_the_sandbox_ends_with_the_loop(fake, monkeypatch, seaweed, tmp_path):  # noqa: F811
    bucket = "detached-modal"
    seaweed.client().create_bucket(Bucket=bucket)
    s3 = f"s3://{bucket}/runs"
    for key, value in (("ARTCLOUD_S3_ENDPOINT_URL", seaweed.endpoint), ("AWS_ACCESS_KEY_ID", "artcloud-test-key"),
                       ("AWS_SECRET_ACCESS_KEY", "artcloud-test-secret-0123456789")):
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    result = cli("run", str(TRAIN), "--backend", "modal", "--gpu", "H100", "--s3", s3, "--name", "det-modal",
                 "--price-per-hour", "3.95", "--budget-usd", "10", "--detach", "--", *TINY_ARGS, "--steps", "2")
    assert result.returncode == 0, result.stderr
    assert "det-modal is training on its own" in result.stderr

    created = [c for c in fake.calls() if c["method"] == "SandboxCreate"]
    assert len(created) == 1
    text = json.dumps(created[0])
    assert "artcloud run train.py" in text and "--detached-inner" in text and "8443" not in text  # no open port

    summary = wait_for_summary(seaweed, s3, "det-modal")
    assert summary["outcome"] == "succeeded" and summary["price_per_hour"] == 3.95
    assert summary["models"][0]["step"] == 2 and s3_steps(seaweed, s3, "nightly", "five-words")[-1] == 2
    deadline = time.monotonic() + 60
    while fake.live_pids() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert fake.live_pids() == []
    assert "det-modal" not in status_names()


def test_detach_needs_a_cloud_backend_and_s3(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = cli("run", str(TRAIN), "--detach", timeout=60)
    assert result.returncode == 2 and "--detach hands the loop to a cloud sandbox" in result.stderr
    result = cli("run", str(TRAIN), "--detach", "--backend", "modal", timeout=60)
    assert result.returncode == 2 and "--backend modal needs --s3" in result.stderr
    result = cli("run", str(TRAIN), "--detach", "--spot", "--backend", "sky", "--s3", "s3://b/p", timeout=60)
    assert result.returncode == 2 and "--spot with --detach" in result.stderr and len(result.stderr.splitlines()) == 1
    result = cli("run", str(TRAIN), "--spot", "--backend", "modal", "--s3", "s3://b/p", timeout=60)
    assert result.returncode == 2 and "--spot is for --backend sky" in result.stderr
    # A secret as a script argument would show in the sandbox's dashboard (the task's plain env) and logs.
    result = cli("run", str(TRAIN), "--detach", "--backend", "modal", "--s3", "s3://b/p", "--", "--steps", "2",
                 "--hf-token=hf_xyz", timeout=60)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "--hf-token looks like a secret" in result.stderr and "--secret NAME" in result.stderr
    assert "hf_xyz" not in result.stderr + result.stdout




@pytest.mark.slow
def test_artcloud_down_asks_a_live_server_for_its_last_push_first(sky_env, monkeypatch, seaweed, tmp_path):  # noqa: F811
    import asyncio

    import artcloud
    from artcloud.backends.sky import SkyBackend
    from tests.test_modal import one_step

    s3 = use_s3(monkeypatch, seaweed, "down-pushes")
    launch = cli("launch", "--gpu", "H100:1", "--s3", s3, "--name", "live")
    assert launch.returncode == 0, launch.stderr

    async def train_and_leave() -> artcloud.TrainResult:
        backend = SkyBackend(cluster_name="live")
        await backend.start()  # attach
        result = await one_step(backend, "agent")
        await backend.close()  # leave it up, as a laptop that closes its lid
        return result

    assert asyncio.run(train_and_leave()).step == 1
    down = cli("down", "live")
    assert down.returncode == 0, down.stderr
    assert down.stdout.splitlines() == ["live: last checkpoint pushed (agent@1)", "live: torn down"]
    assert s3_steps(seaweed, s3, "modal", "agent")[-1] == 1  # (one_step's project is "modal")
    assert leftover_processes(sky_env) == {}

"""`artcloud run --detach` with the local stand-ins: the SkyPilot stand-in (runs the task's setup and run
as local processes) and the fake Modal control plane (runs the sandbox's command). The runner exits at
once; the loop (`artcloud run --backend local` on the sandbox) trains, pushes to the real S3, uploads its
summary, and the sandbox goes by itself."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.sky_standin import leftover_processes
from tests.test_modal import fake  # noqa: F401  (fixture)
from tests.test_run import TINY_ARGS, TRAIN, s3_steps
from tests.test_sky import sky_env, use_s3  # noqa: F401  (fixture)


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
    return [json.loads(line)["name"] for line in result.stdout.splitlines() if line.strip()]


@pytest.mark.slow
def test_detach_on_sky_the_runner_exits_and_the_loop_finishes_on_the_cluster(sky_env, monkeypatch, seaweed, tmp_path):  # noqa: F811
    s3 = use_s3(monkeypatch, seaweed, "detached-sky")
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    result = cli("run", str(TRAIN), "--backend", "sky", "--gpu", "H100:1", "--s3", s3, "--name", "det-sky",
                 "--budget-usd", "50", "--detach", "--", *TINY_ARGS, "--steps", "2")
    assert result.returncode == 0, result.stderr
    assert "det-sky is training on its own: `artcloud logs det-sky -f`" in result.stderr
    local = json.loads((tmp_path / "artcloud-run.json").read_text())
    assert local["outcome"] == "detached" and local["detached"] and local["sandbox"] == "det-sky"
    assert f"{s3}/runs/det-sky/summary.md" in local["reason"]
    launched_in = time.monotonic() - started

    summary = wait_for_summary(seaweed, s3, "det-sky")
    assert summary["outcome"] == "succeeded" and summary["detached"] and summary["backend"] == "local"
    # The budget travelled with the loop: the catalog's price, counted from the launch.
    assert summary["budget_usd"] == 50 and summary["price_per_hour"] > 0
    (model,) = summary["models"]
    assert model["step"] == 2 and s3_steps(seaweed, s3, "nightly", "five-words") == [0, 1, 2]
    assert model["final_checkpoint"] == f"{s3}/nightly/five-words/checkpoints/2"
    bucket, _, prefix = s3[5:].partition("/")
    markdown = seaweed.client().get_object(Bucket=bucket, Key=f"{prefix}/runs/det-sky/summary.md")["Body"].read().decode()
    assert "succeeded" in markdown

    # The job ended, so autodown takes the cluster (a stand-in minute is 0.5 s); `status` notices.
    deadline = time.monotonic() + 60
    while "det-sky" in status_names() and time.monotonic() < deadline:
        time.sleep(1.0)
    assert "det-sky" not in status_names()
    assert leftover_processes(sky_env) == {}
    assert launched_in < time.monotonic() - started  # the runner was back before the loop was done


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



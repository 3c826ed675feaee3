"""`artcloud run SCRIPT` end to end with the local backend: a real server, a real S3 (SeaweedFS), the real
CLI in a subprocess, and real signals. Each test checks the exit code, the summary, the checkpoints on S3
and that nothing the run started is still running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.seaweed import ACCESS_KEY, SECRET_KEY

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "ci" / "train.py"
TINY_ARGS = ["--model", "artcloud/tiny-random", "--group", "4", "--max-tokens", "8"]

# Trains one step after another until stopped (a nightly job that would run all night).
FOREVER = textwrap.dedent("""
    import asyncio
    import artcloud

    async def rollout(client, model, seed):
        messages = [{{"role": "user", "content": "Say something."}}]
        r = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=4, logprobs=True, seed=seed)
        # Rewards that always differ within a group, so every step trains.
        return artcloud.Trajectory(messages_and_choices=[*messages, r.choices[0]], reward=seed / 4)

    async def main():
        async with artcloud.backend_from_env() as backend:
            model = artcloud.TrainableModel(name="forever", project="ci", base_model="artcloud/tiny-random")
            await model.register(backend)
            client = model.openai_client()
            while True:
                groups = await artcloud.gather_trajectory_groups(
                    [artcloud.TrajectoryGroup(rollout(client, model, s) for s in range(4))])
                result = await model.train(groups, progress=False)
                print(f"trained step {{result.step}}", flush=True)
                if {fail_at} and result.step >= {fail_at}:
                    raise SystemExit("the reward function broke")

    asyncio.run(main())
""")


@pytest.fixture
def run_env(tmp_path, seaweed, monkeypatch):
    bucket = f"run-{tmp_path.name[-20:].lower().replace('_', '-')}"
    seaweed.client().create_bucket(Bucket=bucket)
    env = {**os.environ, "ARTCLOUD_S3_ENDPOINT_URL": seaweed.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
           "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path / "home"),
           "ARTCLOUD_HOME": str(tmp_path / "state"), "GITHUB_STEP_SUMMARY": str(tmp_path / "step-summary.md"),
           "PYTHONPATH": str(REPO)}
    env.pop("ARTCLOUD_BACKEND", None)
    (tmp_path / "home").mkdir()
    return env, f"s3://{bucket}/runs"


def start_run(tmp_path, env, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "artcloud", "run", *args], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def forever_script(tmp_path, fail_at: int = 0) -> Path:
    script = tmp_path / f"forever_{fail_at}.py"
    script.write_text(FOREVER.format(fail_at=fail_at))
    return script


def leftovers(*needles: str) -> list[str]:
    """Command lines of live processes that mention any needle (the run's script, its server's folder)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(line for line in (Path("/proc") / pid / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if "zombie" not in state and any(n in cmd for n in needles) and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd}")
    return found


def s3_steps(seaweed, s3: str, project: str, model: str) -> list[int]:
    bucket, _, prefix = s3[5:].partition("/")
    keys = [o["Key"] for page in seaweed.client().get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{prefix}/{project}/{model}/checkpoints/") for o in page.get("Contents", [])]
    return sorted({int(k.split("/")[-2]) for k in keys if k.endswith("/manifest.json")})


def assert_pushed_through(seaweed, s3: str, project: str, model: str, last: int) -> None:
    """Step `last` is on S3, and no step that this run did not make. Earlier ones may be missing: a step committed
    while an older one uploads waits, and only the newest waiting step is pushed (pusher.py); it carries every
    file a resume needs. Which steps that skips depends on the machine's speed."""
    steps = s3_steps(seaweed, s3, project, model)
    assert steps[-1:] == [last] and set(steps) <= set(range(last + 1)), steps


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 180) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"never saw {text!r}; output:\n{''.join(lines)}")


def finish(proc: subprocess.Popen, timeout: float = 180) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


@pytest.mark.slow
def test_run_succeeds_with_summary_checkpoints_on_s3_and_nothing_left(tmp_path, run_env, seaweed):
    env, s3 = run_env
    data = tmp_path / "server-data"
    proc = start_run(tmp_path, env, str(TRAIN), "--s3", s3, "--path", str(data), "--name", "nightly-1",
                     "--", *TINY_ARGS, "--steps", "2")
    out = finish(proc)
    assert proc.returncode == 0, out
    assert "artcloud run: succeeded (the script finished)" in out and "exit 0" in out

    summary = json.loads((tmp_path / "artcloud-run.json").read_text())
    assert summary["outcome"] == "succeeded" and summary["exit_code"] == 0 and summary["script_exit_code"] == 0
    assert summary["run"] == "nightly-1" and summary["backend"] == "local" and summary["teardown"]["ok"]
    (model,) = summary["models"]
    assert (model["project"], model["name"], model["step"]) == ("nightly", "five-words", 2)
    assert [h["step"] for h in model["history"]] == [1, 2]
    assert all(0.0 <= h["reward_mean"] <= 1.0 for h in model["history"])
    assert_pushed_through(seaweed, s3, "nightly", "five-words", 2)
    assert [c["uri"] for c in model["checkpoints"]][-1] == f"{s3}/nightly/five-words/checkpoints/2" == model["final_checkpoint"]
    assert summary["estimated_cost_usd"] == 0.0 and summary["wall_time_s"] > 0
    # Where the start-up went: the script's register loaded the engine, its first rollout came after.
    assert [r["phase"] for r in summary["cold_start"]] == ["provision", "start", "engine", "first rollout"]

    markdown = (tmp_path / "artcloud-run.md").read_text()
    assert "succeeded" in markdown and "xychart-beta" in markdown and "| first rollout |" in markdown
    assert (tmp_path / "step-summary.md").read_text().strip() == markdown.strip()  # $GITHUB_STEP_SUMMARY got it too
    assert "Bearer" not in markdown + json.dumps(summary)
    assert leftovers(str(data)) == []


@pytest.mark.slow
def test_failing_script_exits_with_its_status_and_is_torn_down(tmp_path, run_env, seaweed):
    env, s3 = run_env
    script = forever_script(tmp_path, fail_at=1)
    data = tmp_path / "server-data"
    proc = start_run(tmp_path, env, str(script), "--s3", s3, "--path", str(data))
    out = finish(proc)
    assert proc.returncode == 1, out
    assert "the reward function broke" in out
    summary = json.loads((tmp_path / "artcloud-run.json").read_text())
    assert (summary["outcome"], summary["script_exit_code"]) == ("script_failed", 1)
    assert summary["reason"] == "the script exited with status 1" and summary["teardown"]["ok"]
    assert s3_steps(seaweed, s3, "ci", "forever") == [0, 1]
    assert summary["models"][0]["final_checkpoint"] == f"{s3}/ci/forever/checkpoints/1"
    assert leftovers(str(data), str(script)) == []


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_mid_run_pushes_the_last_checkpoint_and_tears_down(tmp_path, run_env, seaweed, sig):
    env, s3 = run_env
    script = forever_script(tmp_path)
    data = tmp_path / "server-data"
    proc = start_run(tmp_path, env, str(script), "--s3", s3, "--path", str(data))
    wait_for_line(proc, "trained step 2")
    proc.send_signal(sig)  # a CI cancel (SIGINT, then SIGTERM), or Ctrl-C in a terminal
    out = finish(proc)
    assert proc.returncode == 128 + sig, out
    assert f"{sig.name}: stopping the script" in out
    summary = json.loads((tmp_path / "artcloud-run.json").read_text())
    assert summary["outcome"] == "interrupted" and summary["reason"] == f"stopped by {sig.name}"
    assert summary["teardown"]["ok"] and "final checkpoint pushed" in summary["teardown"]["detail"]
    (model,) = summary["models"]
    on_s3 = s3_steps(seaweed, s3, "ci", "forever")
    # The newest committed step is on S3: the server pushed it before it went. A step in flight at the
    # signal is dropped by the shutdown, so S3 is never ahead of the summary.
    assert model["step"] >= 2 and on_s3[-1] == model["step"]
    assert model["final_checkpoint"] == f"{s3}/ci/forever/checkpoints/{on_s3[-1]}"
    assert leftovers(str(data), str(script)) == []


class HeldClock:
    """The runner's clock for a limit test: held at the start until `ready()` (polled in a thread) says the
    run got where the test wants it, then moved on to `limit_s` after the start, and running from there.
    The limit strikes right after that point on every run, however slow the machine: with the wall clock,
    a loaded machine reached a 20 s budget before the script had trained a step."""

    def __init__(self, limit_s: float, ready, give_up_s: float = 300.0):
        self.start, self.skew = time.time(), None
        self._done = threading.Event()
        threading.Thread(target=self._poll, args=(limit_s, ready, give_up_s), daemon=True).start()

    def _poll(self, limit_s, ready, give_up_s):
        deadline = time.monotonic() + give_up_s  # never there: the limit strikes anyway, and the test says why
        while not self._done.is_set() and not ready() and time.monotonic() < deadline:
            self._done.wait(0.2)
        self.skew = self.start + limit_s - time.time()

    def __call__(self) -> float:
        return self.start if self.skew is None else time.time() + self.skew

    def close(self) -> None:
        self._done.set()


def run_held(tmp_path, env, monkeypatch, clock: HeldClock, **options) -> tuple[int, dict]:
    """`artcloud run` in this process (so that the test owns its clock): its exit code and summary."""
    import asyncio

    from artcloud.runner import Runner, RunOptions

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    opts = RunOptions(**options)
    opts.check()
    try:
        code = asyncio.run(Runner(opts, say=lambda line: None, clock=clock).run())
    finally:
        clock.close()
    return code, json.loads((tmp_path / "artcloud-run.json").read_text())


@pytest.mark.slow
def test_budget_stops_cleanly_with_exit_4(tmp_path, run_env, seaweed, monkeypatch):
    env, s3 = run_env
    script = forever_script(tmp_path)
    data = tmp_path / "server-data"
    # $360/h is 10 cents a second: the $2 budget is spent 20 s after the launch, by the runner's clock,
    # which the test holds until step 1 is on S3.
    clock = HeldClock(20.0, lambda: s3_steps(seaweed, s3, "ci", "forever")[-1:] >= [1])
    code, summary = run_held(tmp_path, env, monkeypatch, clock, script=script, s3=s3, path=data,
                             price_per_hour=360.0, budget_usd=2.0)
    assert code == 4, summary
    assert summary["outcome"] == "budget" and summary["reason"].startswith("budget $2.00 reached after ")
    assert summary["reason"].endswith(" at $360.00/h")
    assert 2.0 <= summary["estimated_cost_usd"] < 2.0 + 0.1 * 60  # stopped at the cap, teardown included
    assert summary["teardown"]["ok"]
    (model,) = summary["models"]
    assert model["step"] >= 1 and s3_steps(seaweed, s3, "ci", "forever")[-1] == model["step"]
    assert leftovers(str(data), str(script)) == []


@pytest.mark.slow
def test_max_duration_stops_with_exit_124(tmp_path, run_env, monkeypatch):
    from artcloud.storage.checkpoints import committed_steps

    env, _ = run_env
    script = forever_script(tmp_path)
    data = tmp_path / "server-data"
    clock = HeldClock(15.0, lambda: committed_steps(data / "ci" / "forever")[-1:] >= [1])
    code, summary = run_held(tmp_path, env, monkeypatch, clock, script=script, path=data, max_duration_s=15.0)
    assert code == 124, summary
    assert summary["outcome"] == "timeout" and summary["reason"] == "--max-duration 15s reached"
    assert summary["teardown"]["ok"] and summary["s3"] is None
    # Without S3 the checkpoints stay in the server's folder, and the summary says where.
    (model,) = summary["models"]
    assert model["step"] >= 1
    assert model["final_checkpoint"] == str(data.resolve() / "ci" / "forever" / "checkpoints" / str(model["step"]))
    assert leftovers(str(data), str(script)) == []


@pytest.mark.parametrize("args, message", [
    (["missing.py"], "no script at missing.py: give the path of a Python training script"),
    (["{train}", "--backend", "sky"], "--backend sky needs --s3 s3://BUCKET/PREFIX"),
    (["{train}", "--backend", "modal", "--s3", "s3://b/p", "--budget-usd", "5"], "--budget-usd on modal needs --price-per-hour"),
    (["{train}", "--budget-usd", "0"], "--budget-usd must be more than 0"),
    (["{train}", "--backend", "gcp"], "--backend is local, sky or modal, not 'gcp'"),
    (["{train}", "--summary", "out.md"], "--summary takes the JSON path"),
    (["{train}", "--max-duration", "soon"], "--max-duration"),
    (["{train}", "--gpu", "H100", "--s3", "s3://b/p"], "gpu does not apply to the local backend"),
])
def test_bad_options_are_one_line_with_exit_2(tmp_path, run_env, args, message):
    env, _ = run_env
    args = [a.replace("{train}", str(TRAIN)) for a in args]
    result = subprocess.run([sys.executable, "-m", "artcloud", "run", *args], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("artcloud: error: ") and message in lines[0], result.stderr
    assert not (tmp_path / "artcloud-run.json").exists()


def test_run_help_teaches_flags_and_exit_codes():
    result = subprocess.run([sys.executable, "-m", "artcloud", "run", "--help"], capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "200"}, timeout=60)
    assert result.returncode == 0
    for text in ("--backend", "--budget-usd", "--price-per-hour", "--detach", "--summary", "--max-duration",
                 "124", "6 the final checkpoint push to S3 was not confirmed", "backend_from_env"):
        assert text in result.stdout, text


# Registers, waits until step 0 is on S3, then trains one step once the test says so (after it has
# stopped the S3 server): that step can never reach S3.
UNSAFE = textwrap.dedent("""
    import asyncio, os, sys
    import artcloud

    async def main():
        async with artcloud.backend_from_env() as backend:
            model = artcloud.TrainableModel(name="unsafe", project="ci", base_model="artcloud/tiny-random")
            await model.register(backend)
            while getattr((await backend.model_info("unsafe")).s3, "pushed_step", None) != 0:
                await asyncio.sleep(0.2)
            print("step 0 on S3", flush=True)
            while not os.path.exists(sys.argv[1]):
                await asyncio.sleep(0.2)
            client = model.openai_client()
            messages = [{"role": "user", "content": "Say something."}]
            trajectories = []
            for seed in range(4):
                r = await client.chat.completions.create(model="unsafe", messages=messages, max_tokens=4, logprobs=True, seed=seed)
                trajectories.append(artcloud.Trajectory(messages_and_choices=[*messages, r.choices[0]], reward=seed / 4))
            result = await model.train([artcloud.TrajectoryGroup(trajectories)], progress=False)
            print(f"trained step {result.step}", flush=True)

    asyncio.run(main())
""")


@pytest.mark.slow
def test_final_push_that_fails_is_exit_6_not_success(tmp_path, run_env):
    """The script succeeds, but S3 went away before its step could be pushed: the run says so (exit 6),
    tears down anyway, and the summary names the step that is on S3."""
    from tests.seaweed import SeaweedS3

    env, _ = run_env
    own = SeaweedS3(tmp_path / "own-s3").start()  # stopped mid-run: no other test's S3
    try:
        own.client().create_bucket(Bucket="unsafe")
        # 2 tries per request, not 6: the verdict is the same, reached a minute sooner.
        env = {**env, "ARTCLOUD_S3_ENDPOINT_URL": own.endpoint, "ARTCLOUD_S3_ATTEMPTS": "2"}
        script, go = tmp_path / "unsafe.py", tmp_path / "go"
        script.write_text(UNSAFE)
        data = tmp_path / "server-data"
        proc = start_run(tmp_path, env, str(script), "--s3", "s3://unsafe/runs", "--path", str(data), "--", str(go))
        wait_for_line(proc, "step 0 on S3")
        own.stop()
        go.touch()
        out = finish(proc, timeout=600)
    finally:
        own.stop()
    assert proc.returncode == 6, out
    assert "trained step 1" in out
    summary = json.loads((tmp_path / "artcloud-run.json").read_text())
    assert summary["outcome"] == "push_unconfirmed" and summary["exit_code"] == 6 and summary["script_exit_code"] == 0
    assert summary["reason"] == "the final push was not confirmed for unsafe@1; the script finished"
    assert summary["teardown"]["ok"] and summary["teardown"]["unpushed"] == ["unsafe@1"]
    assert "last checkpoint NOT pushed (unsafe@1): " in summary["teardown"]["detail"]
    assert "the newest step on S3 is 0" in summary["teardown"]["detail"]
    assert summary["teardown"]["detail"].endswith("the local server torn down")
    assert "exit 6" in out
    assert leftovers(str(data), str(script)) == []


def test_progress_snapshots_read_the_models_from_the_authenticated_status(tmp_path):
    """/health tells the world only status, version and readiness: the runner's snapshots (what the summary
    reports when the final answer never comes) read the models from GET /artcloud/status."""
    import asyncio

    import artcloud
    from artcloud.runner import Runner, RunOptions

    async def main():
        async with artcloud.LocalBackend(path=tmp_path / "local") as backend:
            model = artcloud.TrainableModel(name="watched", project="ci", base_model="artcloud/tiny-random")
            await model.register(backend)
            runner = Runner(RunOptions(script=TRAIN), say=lambda line: None)
            runner.backend = backend
            await runner._snapshot()
            return runner.models

    models = asyncio.run(main())
    assert list(models) == ["watched"]
    assert (models["watched"]["project"], models["watched"]["step"]) == ("ci", 0)


def test_secret_looking_arguments_stay_out_of_the_json_summary(tmp_path, monkeypatch):
    """The JSON summary goes to S3 (detached runs) and CI artifacts: a secret passed as a script argument is
    *** there, as in the Markdown."""
    from artcloud.runner import Ending, Runner, RunOptions

    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    said: list[str] = []
    runner = Runner(RunOptions(script=TRAIN, args=["--api-key", "sk-abc123", "--hf-token=hf_xyz", "--steps", "2"],
                               summary=tmp_path / "run.json"), say=said.append)
    runner._report(runner._summary(Ending("succeeded", 0, "the script finished"), {"ok": True, "detail": "nothing was started"}))
    text = (tmp_path / "run.json").read_text() + (tmp_path / "run.md").read_text() + "".join(said)
    assert json.loads((tmp_path / "run.json").read_text())["args"] == ["--api-key", "***", "--hf-token=***", "--steps", "2"]
    assert "sk-abc123" not in text and "hf_xyz" not in text

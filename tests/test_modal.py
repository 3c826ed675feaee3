"""ModalBackend with the REAL modal client (1.6.4) against a fake Modal control plane (tests/modal_fake/).

The fake runs the sandbox's command as a local process and puts a TLS-terminating tunnel in front of it,
as Modal's encrypted ports do; it records images instead of building them. Everything on this side of
Modal's API is the real code: the client, the image recipe, the secret, the server behind the tunnel.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import artcloud
from artcloud.backends import modal as modal_backend
from artcloud.backends.modal import ModalBackend, ModalError
from artcloud.backends.state import StateDir
from artcloud.backends.wheel import build_wheel, wheel_requirements
from tests.modal_fake import FakeModal
from tests.seaweed import ACCESS_KEY, SECRET_KEY

TINY = "artcloud/tiny-random"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake(tmp_path, monkeypatch):
    fake = FakeModal(tmp_path / "modal").start()
    fake.install(monkeypatch)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ARTCLOUD_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "ARTCLOUD_S3_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    try:
        yield fake
    finally:
        fake.stop()
        FakeModal.forget_env_client()
    assert fake.live_pids() == []


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "artcloud", *args], capture_output=True, text=True, timeout=timeout)


def fresh_image():
    """An image object of its own: `modal` keeps the id of a default image it loaded, which the next test's
    fake does not know."""
    import modal

    return modal.Image.debian_slim(python_version="3.11")


async def one_step(backend, name: str) -> artcloud.TrainResult:
    model = artcloud.TrainableModel(name=name, project="modal", base_model=TINY, lora=artcloud.LoraConfig(rank=4))
    await model.register(backend)
    client = model.openai_client()
    messages = [{"role": "user", "content": "hi"}]
    trajectories = []
    for _ in range(4):
        r = await client.chat.completions.create(model=name, messages=messages, max_tokens=6, logprobs=True)
        trajectories.append(artcloud.Trajectory(messages_and_choices=[*messages, r.choices[0]],
                                                reward=len(r.choices[0].message.content or "")))
    return await model.train([artcloud.TrajectoryGroup(trajectories)], progress=False)


# ----------------------------------------------------------------------------------------- bad input


def test_unknown_gpu_and_timeouts_over_the_cap_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="Modal has no GPU 'X100'"):
        ModalBackend(gpu="X100")
    with pytest.raises(ValueError, match="over Modal's 24 h cap"):
        ModalBackend(timeout="25h")
    result = cli("launch", "--provider", "modal", "--gpu", "X100")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "Modal has no GPU 'X100'" in result.stderr


def test_gpu_counts_over_modals_per_type_cap_are_refused():
    with pytest.raises(ValueError, match=r"at most 4 A10 GPUs in one sandbox, not 5: ask for 'A10:4' or fewer"):
        ModalBackend(gpu="A10:5")
    with pytest.raises(ValueError, match=r"at most 8 H100 GPUs in one sandbox, not 9"):
        ModalBackend(gpu="H100:9")
    with pytest.raises(ValueError, match=r"Modal has no GPU 'H100:'"):
        ModalBackend(gpu="H100:")
    assert ModalBackend(gpu="A10:4").gpu == "A10:4" and ModalBackend(gpu="L40S:8").gpu == "L40S:8"


def test_idle_timeout_must_outlast_the_lease_and_its_push():
    # Modal's idle timer sees only tunnel traffic: a paused client's server must hit its lease (which pushes the
    # last checkpoint) before Modal kills it
    with pytest.raises(ValueError, match=r"idle_timeout '20m' must be over lease \+ 5m \(15m \+ 5m\).*"
                                         r"Use idle_timeout='21m' or more, or leave it unset"):
        ModalBackend(idle_timeout="20m", lease="15m")
    with pytest.raises(ValueError, match="idle_timeout='11m'"):
        ModalBackend(idle_timeout=5, lease="5m")
    backend = ModalBackend(idle_timeout="21m", lease="15m")
    assert backend.idle_timeout_s > backend.lease_s + modal_backend.PUSH_MARGIN_S > backend.heartbeat_every_s


def test_a_detached_run_cannot_have_an_idle_timeout_since_modal_would_kill_it(fake, tmp_path):
    import modal

    # Why: a detached run has no tunnel and nobody connected; however busy, to Modal it is idle (the fake is as
    # strict), so a sandbox sent as launch_job would send it is killed idle_timeout after it starts.
    app = modal.App.lookup("artcloud", create_if_missing=True)
    job = modal.Sandbox.create("sh", "-c", "while :; do echo step; sleep 0.1; done", app=app, gpu="H100",
                               timeout=60, idle_timeout=1, encrypted_ports=[], image=fresh_image())
    job.wait(raise_on_termination=False)
    assert job.returncode == 137 and "idle" in fake.sandboxes()[job.object_id]["exception"]

    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    backend = ModalBackend(gpu="H100", name="det-idle", idle_timeout="30m", lease="5m")
    with pytest.raises(ModalError, match=r"a detached run cannot have an idle_timeout.*Leave idle_timeout unset") as e:
        asyncio.run(backend.launch_job(script, lambda price: ["--backend", "local"]))
    assert e.value.code == "idle_timeout_detached" and e.value.field == "idle_timeout"
    assert len(fake.calls("SandboxCreate")) == 1 and StateDir().load("det-idle") is None  # nothing launched


def test_no_modal_token_says_what_to_do(fake, monkeypatch):
    monkeypatch.delenv("MODAL_TOKEN_ID")
    monkeypatch.delenv("MODAL_TOKEN_SECRET")
    FakeModal.forget_env_client()
    with pytest.raises(ModalError, match="modal token new") as e:
        asyncio.run(ModalBackend(gpu="H100", name="notoken").start())
    assert e.value.code == "modal_unavailable"
    assert fake.calls("SandboxCreate") == [] and StateDir().all() == []


def test_s3_without_credentials_or_a_bad_secret_name_creates_nothing(fake, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ModalError, match=r"no S3 credentials on this machine for s3://b/p") as e:
        asyncio.run(ModalBackend(gpu="H100", name="nos3", s3="s3://b/p").start())
    assert e.value.field == "s3"
    with pytest.raises(ModalError, match="ARTCLOUD_TOKEN is artcloud's own secret"):
        asyncio.run(ModalBackend(gpu="H100", name="badsecret", secrets={"ARTCLOUD_TOKEN": "x"}).start())
    assert fake.calls("SandboxCreate") == [] and StateDir().all() == []


# ----------------------------------------------------------------------------------------- the image

METADATA = """Metadata-Version: 2.1
Name: artcloud
Version: 0.1.0
Requires-Dist: httpx>=0.27
Requires-Dist: uvloop; sys_platform == "linux"
Requires-Dist: pywin32; sys_platform == "win32"
Provides-Extra: server
Requires-Dist: fastapi>=0.110; extra == "server"
Requires-Dist: transformers>=5.17; python_version >= "3.11" and extra == "server"
Requires-Dist: transformers>=5.20; python_version < "3.11" and extra == "server"
Provides-Extra: gpu
Requires-Dist: artcloud[server]; extra == "gpu"
Requires-Dist: vllm==0.32.0; extra == "gpu"
Provides-Extra: dev
Requires-Dist: pytest>=8; extra == "dev"
"""


GPU_LOCK = (REPO / "artcloud" / "locks" / "gpu.txt").read_text()


def a_wheel(folder: Path, code: str, *, lock: str = GPU_LOCK, metadata: str = METADATA) -> Path:
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "artcloud-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("artcloud/__init__.py", code)
        zf.writestr("artcloud/locks/gpu.txt", lock)
        zf.writestr("artcloud-0.1.0.dist-info/METADATA", metadata)
    return wheel


def test_the_wheels_requirements_with_its_extras_resolved_for_the_image(tmp_path):
    wheel = a_wheel(tmp_path, "")
    assert wheel_requirements(wheel, extras=["gpu"], python="3.11") == [
        "httpx>=0.27", "uvloop", "fastapi>=0.110", "transformers>=5.17", "vllm==0.32.0"]
    assert wheel_requirements(wheel, extras=["gpu"], python="3.10")[3] == "transformers>=5.20"
    # and this artcloud's own wheel

    own = wheel_requirements(build_wheel(tmp_path / "own"), extras=["gpu"], python="3.11")
    names = {r.split("[")[0].split(">")[0].split("=")[0].split("<")[0] for r in own}
    assert {"httpx", "fastapi", "torch", "vllm"} <= names and "pytest" not in names and "artcloud" not in names


def test_a_code_change_keeps_the_dependency_layer_and_installs_the_wheel_without_deps(fake, tmp_path):
    """The dependency layer is the wheel's lock alone (uv, -r LOCK): two wheels with other code and the same
    lock share it, so Modal's cache keeps torch and vLLM; a new lock makes a new one. The wheel comes last."""
    import modal

    app = modal.App.lookup("artcloud", create_if_missing=True)
    newer = GPU_LOCK.replace("\nhttpx==", "\nhttpx==0.27.0\n# was httpx==")
    layers = []
    for i, (code, lock) in enumerate([("VERSION = 1\n", GPU_LOCK), ("VERSION = 2  # a code change\n", GPU_LOCK),
                                      ("VERSION = 2\n", newer)]):
        wheel = a_wheel(tmp_path / str(i), code, lock=lock)
        n = len(fake.calls("ImageGetOrCreate"))
        sb = modal.Sandbox.create("true", app=app, image=modal_backend.server_image(wheel, python="3.11"), timeout=30,
                                  gpu="T4")
        sb.wait(raise_on_termination=False)
        layers.append([c["request"]["image"] for c in fake.calls("ImageGetOrCreate")[n:]])
    deps = [[layer for layer in built if any("--requirements /.uv/0/gpu.txt" in c for c in layer["dockerfile_commands"])]
            for built in layers]
    assert [len(d) for d in deps] == [1, 1, 1]
    assert deps[0] == deps[1] != deps[2]  # same lock, same definition: Modal's cache keeps it; a new lock: a new one
    install = " ".join(deps[0][0]["dockerfile_commands"])
    assert "uv pip install" in install and "vllm" not in install and "pytest" not in install
    # the wheel's own lock is the layer's input: walk the last sandbox's image down to that layer
    image = fake.image(list(fake.sandboxes().values())[-1]["image_id"])
    while not any("/.uv/0/gpu.txt" in c for c in image["dockerfile_commands"]):
        image = fake.image(image["base_images"][0]["image_id"])
    (context,) = image["context_files"]
    assert context["filename"] == "/.0_gpu.txt" and base64.b64decode(context["data"]).decode() == newer
    for built, dep in zip(layers, deps):  # the wheel comes last, with --no-deps
        assert built[-1]["dockerfile_commands"] == ["FROM base",
                                                    "RUN pip install --no-deps '/opt/artcloud/artcloud-0.1.0-py3-none-any.whl'"]
        assert built.index(dep[0]) < len(built) - 2  # the deps layer comes before the wheel's file
    assert layers[0][-2] != layers[1][-2]  # the wheel's own layer changed


def test_a_wheel_without_a_lock_or_with_a_stale_one_is_refused_before_modal_builds(tmp_path):
    from artcloud.locks import NoLock

    with pytest.raises(NoLock, match="ships no lock for the extras 'server' \\(it has: gpu\\)"):
        modal_backend.server_image(a_wheel(tmp_path / "a", ""), extras="server", python="3.11")
    stale = METADATA.replace("vllm==0.32.0", "vllm==0.33.0")
    with pytest.raises(NoLock, match="is stale: it pins vllm==0.32.0, and artcloud asks for vllm==0.33.0: run `make lock`"):
        modal_backend.server_image(a_wheel(tmp_path / "b", "", metadata=stale), python="3.11")
    with pytest.raises(NoLock, match="damaged at line 2"):
        modal_backend.server_image(a_wheel(tmp_path / "c", "", lock="# artcloud 0.1.0 lock for extras: gpu\nvllm>=1\n"),
                                   python="3.11")


def test_without_a_wheel_the_release_goes_on_its_lock_without_deps(fake):
    import modal

    app = modal.App.lookup("artcloud", create_if_missing=True)
    sb = modal.Sandbox.create("true", app=app, image=modal_backend.server_image(None), timeout=30)
    sb.wait(raise_on_termination=False)
    built = [c["request"]["image"]["dockerfile_commands"] for c in fake.calls("ImageGetOrCreate")]
    assert built[-1] == ["FROM base", f"RUN python -m pip install artcloud=={artcloud.__version__} --no-deps"]
    assert built[-2][-1].endswith("--compile-bytecode --requirements /.uv/0/gpu.txt")
    assert built[0][0].startswith("FROM python:%d.%d." % max(sys.version_info[:2], (3, 11)))  # vLLM 0.32 needs 3.11


# ----------------------------------------------------------------------------------------- for real


@pytest.mark.slow
def test_create_train_terminate_and_what_modal_was_sent(fake, tmp_path, monkeypatch, seaweed):
    # S3 credentials as a laptop has them; the fake gives the sandbox none of this machine's AWS_* or ARTCLOUD_*.
    monkeypatch.setenv("ARTCLOUD_S3_ENDPOINT_URL", seaweed.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("ARTCLOUD_S3_ATTEMPTS", "4")  # passed on: the sandbox's server tries as often
    seaweed.client().create_bucket(Bucket="modal-e2e")
    s3 = "s3://modal-e2e/runs"

    async def main():
        backend = ModalBackend(gpu="H100", name="m1", timeout="1h", idle_timeout="20m", lease="5m", s3=s3,
                               tunnel_ca=fake.edge_ca_path, env={"FOO": "bar"})
        async with backend:
            assert backend.base_url.startswith("https://127.0.0.1:")
            assert backend._token not in repr(backend)
            follow = subprocess.Popen([sys.executable, "-m", "artcloud", "logs", "m1", "-f"], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
            result = await one_step(backend, "agent")
            assert result.step == 1
            status = cli("status", "--json")
            row = json.loads(status.stdout.splitlines()[0])
            assert row["name"] == "m1" and row["provider"] == "modal" and row["status"] == "RUNNING", status.stderr
            for _ in range(100):  # the push to S3 runs in the background
                if getattr((await backend.model_info("agent")).s3, "pushed_step", None) == 1:
                    break
                await asyncio.sleep(0.2)
            token = backend._token
        out, err = follow.communicate(timeout=60)  # the stream ends with the sandbox
        assert "serving plain HTTP" in out and token not in out + err, err
        return backend, token

    backend, token = asyncio.run(main())
    from artcloud.storage.s3 import CheckpointStore, S3Config

    assert CheckpointStore(S3Config.from_uri(s3)).latest("modal", "agent") == 1
    (create,) = fake.calls("SandboxCreate")
    sent = fake.sandboxes()[backend.sandbox_id]
    assert sent["gpu"] == "H100" and sent["timeout_secs"] == 3600 and sent["idle_timeout_secs"] == 1200
    assert 8443 in sent["tunnel_ports"] and not sent["running"] and sent["status"] == "GENERIC_STATUS_TERMINATED"
    assert "--behind-https-proxy" in " ".join(sent["args"]) and "--max-duration 3300s" in " ".join(sent["args"])
    assert "ARTCLOUD_TOKEN" in sent["env_names"]
    assert token not in (fake.root / "calls.jsonl").read_text()  # the secret is never recorded in the clear
    secrets = [fake.secret_env(i) for i in create["request"]["definition"]["secret_ids"]]
    assert [s["ARTCLOUD_TOKEN"] for s in secrets if "ARTCLOUD_TOKEN" in s] == [token]  # it travelled as a modal.Secret
    # env= goes as one too (modal's way), with the S3 settings the server needs
    assert {"FOO": "bar", "ARTCLOUD_S3_ENDPOINT_URL": seaweed.endpoint, "ARTCLOUD_S3_ATTEMPTS": "4"} in secrets
    images = json.dumps(fake.calls("ImageGetOrCreate"))
    assert "pip install" in images and SECRET_KEY not in images and token not in images  # nothing secret in the image
    record = StateDir().load("m1")
    assert record.provider == "modal" and record.extra["sandbox_id"] == backend.sandbox_id and record.state == "down"
    again = cli("down", "m1")
    assert again.returncode == 0 and "m1: already gone" in again.stdout


CLIENT = textwrap.dedent("""
    import asyncio, sys
    import artcloud

    async def main():
        backend = artcloud.ModalBackend(gpu="H100", name="orphan", lease="6s", tunnel_ca=sys.argv[1])
        await backend.start()
        model = artcloud.TrainableModel(name="agent", project="modal", base_model="artcloud/tiny-random")
        await model.register(backend)
        print("REGISTERED", backend.sandbox_id, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


@pytest.mark.slow
def test_client_killed_the_sandbox_goes_when_the_lease_runs_out(fake, tmp_path):
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    client = subprocess.Popen([sys.executable, str(script), str(fake.edge_ca_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in client.stdout:
            lines.append(line)
            if line.startswith("REGISTERED"):
                break
        assert lines and lines[-1].startswith("REGISTERED"), "".join(lines)
        sandbox_id = lines[-1].split()[1]
        client.kill()
        killed_at = time.monotonic()
    finally:
        client.kill()
        client.wait()
    while fake.sandboxes()[sandbox_id]["returncode"] is None and time.monotonic() - killed_at < 60:
        time.sleep(0.25)
    gone_after = time.monotonic() - killed_at
    assert not fake.sandboxes()[sandbox_id]["running"] and gone_after < 6 + 10, gone_after
    assert fake.sandboxes()[sandbox_id]["returncode"] == 0  # the server ended itself, cleanly
    assert fake.live_pids() == []
    result = cli("status")
    assert "no live sandboxes" in result.stdout and "orphan" in result.stdout  # found gone, and said so


@pytest.mark.slow
def test_a_sandbox_that_exits_during_start_up_fails_with_its_logs(fake):
    # an engine setting the server refuses at start (the client checks the engine's name, not its settings)
    with pytest.raises(ModalError, match=r"(?s)ended \(exit code 2\).*engine_args block_size: not for the CPU") as e:
        asyncio.run(ModalBackend(gpu="H100", name="dies", engine="cpu", engine_args={"block_size": 16},
                                 tunnel_ca=fake.edge_ca_path).start())
    assert e.value.code == "server_exited"
    assert fake.live_pids() == [] and StateDir().load("dies").state == "down"


@pytest.mark.slow
def test_start_up_waits_inside_create_for_a_gpu_being_scheduled(fake):
    # modal 1.6.4 creates a GPU sandbox through V1, whose create returns only once Modal has scheduled the
    # container (modal/sandbox/_impl_v1.py:158-161): the fake answers no task id until then.
    fake.schedule_delay_s = 3.0

    async def main():
        async with ModalBackend(gpu="H100", name="sched", tunnel_ca=fake.edge_ca_path) as backend:
            assert (await backend.health()).ready
            return backend

    backend = asyncio.run(main())
    assert len(fake.calls("SandboxGetTaskId")) >= 3  # polled every 0.5 s inside create while the GPU was scheduled
    assert fake.sandboxes()[backend.sandbox_id]["status"] == "GENERIC_STATUS_TERMINATED"


# ----------------------------------------------------------------------------------------- no capacity
# With a GPU, modal 1.6.4's Sandbox.create waits inside for Modal to schedule the container, up to 21 minutes
# (modal/sandbox/_impl_v1.py:88, 157-172); the fake never schedules it here. startup_timeout must bound that wait,
# say in one line that there was no capacity and what to do, and leave nothing running.

NO_H100 = "Modal found no H100 capacity for {name} "
WHAT_TO_DO = "try another gpu or region, or again later"


def test_a_gpu_never_scheduled_fails_at_startup_timeout_and_leaves_nothing(fake):
    fake.schedule_delay_s = math.inf
    # 6 s: ample for the few calls before create (App.lookup, the image); then create waits for a task id
    backend = ModalBackend(gpu="H100", name="nosched", startup_timeout="6s", image=fresh_image())
    with pytest.raises(ModalError) as e:
        asyncio.run(backend.start())
    line = str(e.value)
    assert line.startswith(NO_H100.format(name="nosched") + "within startup_timeout 6s: " + WHAT_TO_DO
                           + ", or a longer startup_timeout (terminated"), line
    assert "\n" not in line and e.value.code == "no_capacity"
    (sandbox,) = fake.sandboxes().values()
    assert sandbox["pid"] is None and sandbox["status"] == "GENERIC_STATUS_TERMINATED" and fake.live_pids() == []
    # create was still waiting for the task id when startup_timeout ended it: it never returned
    assert len(fake.calls("SandboxGetTaskId")) >= 2 and fake.calls("SandboxGetTunnels") == []
    record = StateDir().load("nosched")  # saved before Modal was asked, marked down after
    assert record.state == "down" and record.extra == {"app": "artcloud"}


def test_modals_own_scheduling_limit_gives_the_same_line(fake, monkeypatch):
    from modal.sandbox import _impl_v1

    # Modal's 21 minutes, shortened: create terminates the sandbox and raises ResourceExhaustedError itself
    monkeypatch.setattr(_impl_v1, "_SANDBOX_SCHEDULING_TIMEOUT", 1.5)
    fake.schedule_delay_s = math.inf
    with pytest.raises(ModalError) as e:
        asyncio.run(ModalBackend(gpu="H100", name="exhausted", startup_timeout="10m", image=fresh_image()).start())
    line = str(e.value)
    assert line.startswith(NO_H100.format(name="exhausted") + "within Modal's own scheduling wait "
                           "(ResourceExhaustedError: Insufficient capacity to create sandbox.): " + WHAT_TO_DO
                           + " (terminated"), line
    assert "\n" not in line and e.value.code == "no_capacity"
    (sandbox,) = fake.sandboxes().values()
    assert sandbox["pid"] is None and sandbox["status"] == "GENERIC_STATUS_TERMINATED" and fake.live_pids() == []
    assert StateDir().load("exhausted").state == "down"


def test_a_create_whose_answer_never_came_is_found_by_its_launch_tag_and_terminated(fake, monkeypatch):
    # Modal made the sandbox and it runs, but SandboxCreate's answer (its id) never reaches the client: modal's
    # own clean-up cannot reach it (modal/sandbox/_impl_v1.py:154-169), so the backend finds it by its tag.
    monkeypatch.setattr(modal_backend, "server_command", lambda **kw: ["sleep", "600"])
    fake.create_answers.clear()
    with pytest.raises(ModalError) as e:
        asyncio.run(ModalBackend(gpu="H100", name="lost", startup_timeout="6s", image=fresh_image()).start())
    assert str(e.value).startswith(NO_H100.format(name="lost") + "within startup_timeout 6s: "), str(e.value)
    (sandbox,) = fake.sandboxes().values()
    assert sandbox["pid"] is not None  # it had started
    assert not sandbox["running"] and sandbox["status"] == "GENERIC_STATUS_TERMINATED" and fake.live_pids() == []
    assert StateDir().load("lost").state == "down"


def test_a_cpu_sandbox_never_scheduled_fails_at_startup_timeout_on_its_tunnel(fake):
    # without a GPU (modal's V2 path) create returns at once; the ready poll's tunnels() then never answers
    fake.schedule_delay_s, fake.tunnels_wait_cap_s = math.inf, 1.0
    with pytest.raises(ModalError) as e:
        asyncio.run(ModalBackend(gpu=None, name="nocpu", startup_timeout="3s", image=fresh_image()).start())
    line = str(e.value)
    assert line.startswith("Modal did not open the tunnel of nocpu within startup_timeout (its container was not "
                           "running yet): try again later, or a longer startup_timeout (terminated"), line
    assert e.value.code == "startup_timeout"
    (sandbox,) = fake.sandboxes().values()
    assert sandbox["v2"] and sandbox["pid"] is None and sandbox["status"] == "GENERIC_STATUS_TERMINATED"
    assert StateDir().load("nocpu").state == "down"


def test_an_image_still_building_at_startup_timeout_is_not_called_no_capacity(fake):
    fake.build_delay_s = math.inf
    with pytest.raises(ModalError) as e:
        asyncio.run(ModalBackend(gpu="H100", name="slowbuild", startup_timeout="3s", image=fresh_image()).start())
    assert str(e.value).startswith("Modal did not finish building the image of slowbuild within startup_timeout 3s: "
                                   "a first build takes minutes"), str(e.value)
    assert e.value.code == "image_build_timeout"
    assert fake.calls("SandboxCreate") == [] and StateDir().load("slowbuild").state == "down"


@pytest.mark.slow
def test_start_up_failure_shows_stdout_and_stderr_lines_apart(fake, monkeypatch):
    # stdout's last line without a newline must not run into stderr's first
    monkeypatch.setattr(modal_backend, "server_command",
                        lambda **kw: ["sh", "-c", "printf last-stdout; echo the-error >&2; exit 2"])
    with pytest.raises(ModalError, match=r"ended \(exit code 2\)") as e:
        asyncio.run(ModalBackend(gpu="H100", name="tail", tunnel_ca=fake.edge_ca_path).start())
    assert "  last-stdout\n  the-error" in str(e.value)


@pytest.mark.slow
def test_logs_follow_shows_stderr_of_a_running_sandbox(fake, tmp_path):
    import modal

    # the server logs to stderr, and the sandbox runs on: `artcloud logs -f` must not wait for stdout's end.
    # Each line is written once the follower has shown the one before (a barrier of files, not sleeps): lines
    # already waiting on both streams when it starts could come in either order.
    app = modal.App.lookup("artcloud", create_if_missing=True)
    shown = tmp_path / "shown"
    shown.mkdir()
    wait = f"while [ ! -e {shown}/%s ]; do sleep 0.05; done"
    sb = modal.Sandbox.create("sh", "-c", f"echo first-out; {wait % 'first-out'}; echo to-stderr >&2; "
                              f"{wait % 'to-stderr'}; echo second-out; exec sleep 600",
                              app=app, gpu="H100", timeout=120, name="follow", image=fresh_image())
    StateDir().save(modal_backend.SandboxRecord(name="follow", provider="modal", state="up",
                                                extra={"app": "artcloud", "sandbox_id": sb.object_id}))
    follow = subprocess.Popen([sys.executable, "-m", "artcloud", "logs", "follow", "-f"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    arrived: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [arrived.put(line.rstrip("\n")) for line in follow.stdout], daemon=True).start()
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while len(lines) < 3 and time.monotonic() < deadline:
            try:
                lines.append(arrived.get(timeout=1))
            except queue.Empty:
                continue
            (shown / lines[-1]).touch()
        assert lines == ["first-out", "to-stderr", "second-out"], lines  # both streams, in arrival order
        assert sb.poll() is None  # while it still runs
    finally:
        sb.terminate()
        out, err = follow.communicate(timeout=60)  # the stream ends with the sandbox
    assert follow.returncode == 0, err


@pytest.mark.slow
def test_a_tunnel_that_never_answers_times_out_and_terminates(fake, monkeypatch):
    # Fault: a server that never listens (the tunnel exists from the start, as on Modal).
    monkeypatch.setattr(modal_backend, "server_command", lambda **kw: ["sh", "-c", "sleep 600"])
    with pytest.raises(ModalError, match=r"not ready in time \(startup_timeout\).*terminated"):
        asyncio.run(ModalBackend(gpu="H100", name="silent", startup_timeout="4s", tunnel_ca=fake.edge_ca_path).start())
    (sandbox,) = fake.sandboxes().values()
    assert not sandbox["running"] and sandbox["status"] == "GENERIC_STATUS_TERMINATED"
    assert StateDir().load("silent").state == "down" and os.environ.get("MODAL_SERVER_URL") == fake.url


@pytest.mark.slow
def test_cli_launch_status_and_down_all_on_modal(fake, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(fake.edge_ca_path))  # the fake edge's CA stands in for the public ones
    result = cli("launch", "--provider", "modal", "--gpu", "L4", "--name", "cli1", "--max-duration", "2h")
    assert result.returncode == 0, result.stderr
    assert "cli1 is up: https://127.0.0.1:" in result.stdout and "ModalBackend(name='cli1')" in result.stdout
    assert "  cold start:           provision " in result.stdout and ", start " in result.stdout  # where the time went
    (sandbox,) = fake.sandboxes().values()
    assert sandbox["running"] and sandbox["gpu"] == "L4" and sandbox["timeout_secs"] == 7200

    async def attach():  # reconnect by name: no second sandbox
        backend = ModalBackend(name="cli1", tunnel_ca=fake.edge_ca_path)
        await backend.start()
        assert (await backend.health()).ready and backend.sandbox_id == sandbox["id"]
        await backend.close()

    asyncio.run(attach())
    assert len(fake.sandboxes()) == 1
    status = cli("status")
    assert "cli1" in status.stdout and "modal" in status.stdout and "RUNNING" in status.stdout
    down = cli("down", "--all", "--yes")
    assert down.returncode == 0 and "cli1: torn down" in down.stdout
    assert "cli1: server stopped (no models)" in down.stdout  # asked first, through the tunnel, with the token
    assert not fake.sandboxes()[sandbox["id"]]["running"] and fake.live_pids() == []


@pytest.mark.slow
def test_a_cpu_only_sandbox_takes_modals_other_path(fake):
    """modal 1.6.4 creates a sandbox without a GPU through its V2 calls (secrets inline, another stdio API),
    whose create does not wait for the container: `tunnels()` raises SandboxTimeoutError until it runs (one
    call waits at most the fake's cap, 1 s here), and start() asks again until its startup_timeout."""
    fake.schedule_delay_s, fake.tunnels_wait_cap_s = 3.0, 1.0

    async def main():
        async with ModalBackend(gpu=None, name="cpu1", tunnel_ca=fake.edge_ca_path) as backend:
            assert (await backend.health()).ready
            return backend

    backend = asyncio.run(main())
    sandbox = fake.sandboxes()[backend.sandbox_id]
    assert sandbox["v2"] and sandbox["gpu"] is None and not sandbox["running"]
    assert "SandboxCreateV2" in fake.methods() and "SandboxCreate" not in fake.methods()
    assert len(fake.calls("SandboxGetTunnelsV2")) >= 3  # timed out while scheduling, then answered

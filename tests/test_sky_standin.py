"""The SkyPilot stand-in (tests/sky_standin.py) on its own: it runs the task's real setup and run commands.

The slow tests launch the real task (sky/artcloud-server.yaml filled by build_task) with the real wheel of
this artcloud: pip installs it into the "cluster's" venv, and `artcloud serve` from that venv answers
over HTTPS on loopback. The others use small hand-written tasks for the stand-in's own mechanics.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers import find_python, wait_for

from artcloud import locks as artcloud_locks
from artcloud._version import __version__
from artcloud.backends.sky_api import ClusterInfo, sky_api
from artcloud.backends.sky_task import SERVER_PORT, build_task
from artcloud.backends.wheel import build_wheel
from artcloud.tls import client_ssl_context, make_launch_secrets
from tests.sky_standin import (
    ENV_CATALOG,
    ENV_CLOUDS,
    ENV_FAULT,
    ENV_MINUTE,
    ENV_NODE,
    ENV_ROOT,
    REPO_ROOT,
    ClusterDoesNotExist,
    LocalSky,
    RecordingSky,
    ResourcesUnavailableError,
    StandinError,
    StandinLaunchError,
    _marker_of,
    cluster_pids,
    down_all,
    leftover_processes,
    read_calls,
)


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "sky"
    monkeypatch.setenv(ENV_ROOT, str(root))
    monkeypatch.setenv(ENV_MINUTE, "0.5")
    for name in (ENV_CLOUDS, ENV_CATALOG, ENV_FAULT):
        monkeypatch.delenv(name, raising=False)
    yield root
    down_all(root)  # whatever a test left: torn down, and nothing may survive it
    assert leftover_processes(root) == {}


@pytest.fixture
def sky(root) -> LocalSky:
    return LocalSky()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def launch_secrets():
    made = make_launch_secrets()
    return made, {"ARTCLOUD_TOKEN": made.token, "ARTCLOUD_TLS_CERT": made.server_cert,
                  "ARTCLOUD_TLS_KEY": made.server_key}


def small_task(run: str, setup: str = "echo setting up in $PWD", **envs: str) -> dict:
    return {"name": "small", "resources": {"accelerators": "L4:1", "ports": 8443}, "envs": envs,
            "setup": setup, "run": run}


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---------------------------------------------------------------------------------------------- no cluster


def test_root_is_required(monkeypatch):
    monkeypatch.delenv(ENV_ROOT, raising=False)
    with pytest.raises(StandinError, match=ENV_ROOT):
        LocalSky()


def test_sky_api_names_the_standin(root, monkeypatch):
    monkeypatch.setenv("ARTCLOUD_SKY_API", "tests.sky_standin:LocalSky")
    api = sky_api()
    assert isinstance(api, LocalSky) and api.root == root.resolve()


def test_missing_cluster(sky):
    assert sky.status("nope") is None
    assert sky.job_status("nope", 1) is None
    assert sky.endpoint("nope", SERVER_PORT) is None
    assert sky.down("nope") is False
    with pytest.raises(ClusterDoesNotExist):
        sky.logs("nope")
    with pytest.raises(ClusterDoesNotExist):
        sky.autostop("nope", 5)


def test_clouds_and_catalog(sky, monkeypatch):
    assert sky.check_cloud("local") is None
    reason = sky.check_cloud("aws")
    assert reason.startswith("AWS: ") and "aws configure" in reason and "docs.skypilot.co" in reason
    monkeypatch.setenv(ENV_CLOUDS, "local,aws")
    assert sky.check_cloud("AWS") is None

    h100 = sky.gpu_offers("H100")
    assert {(o.cloud, o.count) for o in h100} >= {("local", 1), ("aws", 8), ("gcp", 1), ("gcp", 8)}
    assert all(o.price and o.spot_price and o.spot_price < o.price for o in h100 if o.cloud != "kubernetes")
    assert {(o.cloud, o.count) for o in sky.gpu_offers("l4")} >= {("local", 1)}
    assert sky.gpu_offers("A100-80GB") and sky.gpu_offers("T4")
    assert sky.gpu_offers("H200") == []
    monkeypatch.setenv(ENV_CATALOG, "offline")
    assert sky.gpu_offers("H100") is None


def test_launch_checks_resources_like_sky(sky, monkeypatch):
    _, secrets = launch_secrets()
    task = build_task(secrets=secrets, gpu="A100-80GB:1").config
    with pytest.raises(ResourcesUnavailableError, match="A100-80GB:1"):
        sky.launch(task, secrets=secrets, cluster_name="a100", idle_minutes=5)
    task = build_task(secrets=secrets, gpu="H100:1", cloud="aws").config
    with pytest.raises(ResourcesUnavailableError, match="AWS which is not enabled"):
        sky.launch(task, secrets=secrets, cluster_name="aws", idle_minutes=5)
    with pytest.raises(RuntimeError, match="No value available for secret.*ARTCLOUD_TLS_KEY"):  # named, not given
        sky.launch(task, secrets={k: v for k, v in secrets.items() if k != "ARTCLOUD_TLS_KEY"},
                   cluster_name="nokey", idle_minutes=5)
    assert sky.status("a100") is None and sky.status("aws") is None and sky.status("nokey") is None


# ---------------------------------------------------------------------------------------------- small tasks


def test_job_logs_and_autodown(sky, root, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "from-the-laptop")  # a cloud VM has none of this
    task = small_task("echo home=$HOME; echo port=$ARTCLOUD_PORT host=$ARTCLOUD_HOST; echo gpus=$SKYPILOT_NUM_GPUS_PER_NODE;"
                      " echo aws=${AWS_SECRET_ACCESS_KEY:-} secret=$MY_SECRET env=$MY_ENV;"
                      " for i in 1 2 3; do echo line $i; sleep 0.3; done",
                      ARTCLOUD_PORT="8443", MY_ENV="e")
    assert sky.launch(task, secrets={"MY_SECRET": "s"}, cluster_name="small", idle_minutes=1).job_id == 1
    info = sky.status("small")
    assert isinstance(info, ClusterInfo) and info.status == "UP" and info.autostop_minutes == 1 and info.to_down
    assert info.resources == "1x Local(local-l4-1, {'L4': 1})"
    lines = list(sky.logs("small", follow=True))  # until the job ends
    home = root.resolve() / "clusters" / "small" / "home"
    assert lines[0] == f"setting up in {home}/sky_workdir"
    assert lines[1] == f"home={home}"
    assert lines[2].startswith("port=") and lines[2] != "port=8443" and lines[2].endswith("host=127.0.0.1")
    assert lines[3:] == ["gpus=1", "aws= secret=s env=e", "line 1", "line 2", "line 3"]
    assert sky.job_status("small", 1) == "SUCCEEDED"
    assert list(sky.logs("small", tail=2)) == ["line 2", "line 3"]
    assert sky.endpoint("small", SERVER_PORT) is None  # the job is over
    # Autodown: 1 "minute" (0.5 s here) after the job ended, the cluster is gone.
    wait_for("autodown", lambda: sky.status("small") is None, timeout=10)
    assert not (root / "clusters" / "small").exists()


def test_autostop_can_be_changed_and_relaunch(sky):
    assert sky.launch(small_task("exit 0"), secrets={}, cluster_name="c", idle_minutes=None).job_id == 1
    wait_for("job end", lambda: sky.job_status("c", 1) == "SUCCEEDED", timeout=10)
    assert sky.status("c").autostop_minutes == -1
    time.sleep(0.7)
    assert sky.status("c").status == "UP"  # no autostop: stays up
    # Relaunching a cluster whose job ended runs a second job on it (setup again, too).
    assert sky.launch(small_task("sleep 30"), secrets={}, cluster_name="c", idle_minutes=None).job_id == 2
    wait_for("job 2 running", lambda: sky.job_status("c", 2) == "RUNNING", timeout=10)
    assert sky.job_status("c", 1) == "SUCCEEDED"
    with pytest.raises(StandinLaunchError, match="running job 2"):
        sky.launch(small_task("exit 0"), secrets={}, cluster_name="c", idle_minutes=None)
    sky.autostop("c", 1, down=True)
    info = sky.status("c")
    assert info.autostop_minutes == 1 and info.to_down
    time.sleep(1.0)
    assert sky.status("c") is not None  # a running job is not idle
    assert sky.down("c") is True
    assert sky.status("c") is None and sky.job_status("c", 2) is None


def test_state_is_on_disk_and_survives_a_killed_client(sky, root):
    """The CLI runs in subprocesses: a launch from another process, SIGKILLed after launching, leaves a
    cluster this process sees and tears down."""
    code = ("import json, sys, time; from tests.sky_standin import LocalSky; "
            "print(LocalSky().launch(json.loads(sys.argv[1]), secrets={}, cluster_name='k', idle_minutes=5).job_id, "
            "flush=True); time.sleep(60)")
    client = subprocess.Popen([sys.executable, "-c", code, json.dumps(small_task("sleep 60"))], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "1"
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait()
    wait_for("job running", lambda: sky.job_status("k", None) == "RUNNING", timeout=10)
    assert sky.status("k").autostop_minutes == 5
    assert any("sleep 60" in line for line in leftover_processes(root).values())
    assert sky.down("k") is True
    assert leftover_processes(root) == {}


# ---------------------------------------------------------------------------------------------- the real task


def test_a_failed_setup_is_a_failed_job_and_the_cluster_is_autodowned(sky, root):
    """No wheel and artcloud is not on PyPI: the install cannot resolve. As SkyPilot 0.14.1 does, launch returns once
    the job is submitted (the setup runs inside it), the job ends FAILED_SETUP with uv's own words in its log, and
    the autostop set before the job (PRE_EXEC) takes the cluster down a "minute" later."""
    made, secrets = launch_secrets()
    task = build_task(secrets=secrets, gpu="H100:1", wheel=None)
    launched = sky.launch(task.config, secrets=task.secrets, cluster_name="bad", idle_minutes=1)
    assert launched.job_id == 1
    info = sky.status("bad")
    assert info.status == "UP" and info.autostop_minutes == 1 and info.to_down  # set before the job ran
    wait_for("setup failed", lambda: sky.job_status("bad", 1) not in ("PENDING", "SETTING_UP"), timeout=120)
    assert sky.job_status("bad", 1) == "FAILED_SETUP"
    text = "\n".join(sky.logs("bad"))
    assert "No solution found" in text and "artcloud" in text  # uv's resolution, for real
    assert made.token not in text and made.server_key not in text
    wait_for("autodown", lambda: sky.status("bad", refresh=True) is None, timeout=20)
    assert leftover_processes(root) == {}


def a_wheel_whose_lock_is(wheel: Path, folder: Path, change: str) -> Path:
    """A copy of `wheel` whose gpu lock is kept, left out, damaged (a pin without its version: caught by the
    setup's own check) or given a marker only uv's parser refuses (so uv must have read the file)."""
    import zipfile

    out = folder / wheel.name
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "artcloud/locks/gpu.txt":
                if change == "missing":
                    continue
                if change == "damaged":
                    data = data.replace(b"\ntorch==2.13.0\n", b"\ntorch==\n")
                if change == "bad_marker":
                    data = data.replace(b"\ntorch==2.13.0\n", b"\ntorch==2.13.0 ; python_version >>> '3'\n")
                assert change == "kept" or data != src.read(item)
            dst.writestr(item, data)
    return out


@pytest.mark.parametrize("change,line", [
    ("kept", "artcloud: installing ./artcloud-{v}-py3-none-any.whl[gpu] with its lock (artcloud {v} lock for extras: gpu)"),
    ("missing", "artcloud: ./artcloud-{v}-py3-none-any.whl ships no lock for the extras 'gpu' (it has: server): set "
                "ARTCLOUD_EXTRAS to one of those, or ARTCLOUD_LOCK=0 to resolve without a lock"),
    ("damaged", "/artcloud/locks/gpu.txt is damaged (line {n}:torch==): reinstall artcloud or rebuild the wheel"),
    ("bad_marker", "gpu.txt|at position"),  # uv's own words: it parsed the lock (uv wraps the message at its
                                            # width, where a long temporary path may fall)
], ids=["kept", "missing", "damaged", "bad_marker"])
def test_the_setup_installs_with_the_wheels_lock(sky, root, wheel, tmp_path, change, line):
    """The real setup reads the lock from the wheel it installs and hands it to uv as constraints (uv resolves it
    for real against PyPI, then installs from the image); a missing or damaged lock fails it with one line."""
    made, secrets = launch_secrets()
    task = build_task(secrets=secrets, gpu="H100:1", wheel=a_wheel_whose_lock_is(wheel, tmp_path / change, change))
    task.config["run"] = "echo served"
    n = 1 + (Path(artcloud_locks.__file__).parent / "gpu.txt").read_text().splitlines().index("torch==2.13.0")
    line = line.format(v=__version__, n=n)
    sky.launch(task.config, secrets=task.secrets, cluster_name="lock", idle_minutes=1)
    wait_for("job end", lambda: sky.job_status("lock", 1) in ("SUCCEEDED", "FAILED_SETUP", "FAILED"), timeout=120)
    text = "\n".join(sky.logs("lock"))
    if change == "kept":
        assert sky.job_status("lock", 1) == "SUCCEEDED", text
        assert line in text.splitlines() and text.endswith("served")
        return
    assert sky.job_status("lock", 1) == "FAILED_SETUP", text
    said = " ".join(text.split())
    assert all(" ".join(part.split()) in said for part in line.split("|")), text
    assert "served" not in text


# ---------------------------------------------------------------------------------------------- SkyPilot's views


def test_status_is_the_api_servers_cache_until_refreshed(sky, root, monkeypatch):
    """sky.status() is the API server's cache (StatusRefreshMode.NONE, its daemon refreshing once a minute): a
    machine the cloud took away is still UP there, and so is its endpoint, until a refresh (AUTO) looks."""
    monkeypatch.setenv("ARTCLOUD_STANDIN_STATUS_REFRESH_S", "3600")  # the daemon's minute never comes here
    sky.launch(small_task("sleep 60", ARTCLOUD_PORT="8443"), secrets={}, cluster_name="c", idle_minutes=5)
    wait_for("job running", lambda: sky.job_status("c", 1) == "RUNNING", timeout=10)
    before = sky.endpoint("c", 8443)
    sky.preempt("c", notice_s=0)  # no notice: the machine just goes
    assert leftover_processes(root) == {}
    assert sky.status("c").status == "UP" and sky.endpoint("c", 8443) == before  # stale, as SkyPilot's
    time.sleep(2.0)  # older than the 2 s an AUTO refresh skips (CLUSTER_STATUS_CACHE_DURATION_SECONDS)
    assert sky.job_status("c", 1) is None  # job_status refreshes first (check_cluster_available)
    assert sky.status("c") is None and sky.endpoint("c", 8443) is None  # the refresh updated the cache
    assert sky.down("c") is False


def test_a_preempted_machine_goes_whole_no_process_sees_its_disk_gone(sky, root, tmp_path):
    """A spot VM taken without notice: its processes and its disk go together. A job that ignores SIGTERM (as a
    server's final push does) and writes into $HOME without pause never finds $HOME gone."""
    saw, started = tmp_path / "saw", tmp_path / "started"
    sky.launch(small_task(f"trap '' TERM; touch {started}; "
                          f"while true; do echo x > \"$HOME/f\" || echo gone >> {saw}; done"),
               secrets={}, cluster_name="c", idle_minutes=5)
    wait_for("the writer writes", started.exists, timeout=20)
    sky.preempt("c", notice_s=0)
    assert leftover_processes(root) == {}
    assert not saw.exists(), saw.read_text()


def test_autostopping_still_answers_and_then_goes(sky, root, monkeypatch):
    hold = root / "hold"
    root.mkdir(parents=True, exist_ok=True)
    hold.touch()
    monkeypatch.setenv("ARTCLOUD_STANDIN_HOLD_AUTOSTOP", str(hold))
    sky.launch(small_task("exit 0", ARTCLOUD_PORT="8443"), secrets={}, cluster_name="a", idle_minutes=0)
    wait_for("autostopping", lambda: (sky.status("a", refresh=True) or ClusterInfo("a", "?")).status == "AUTOSTOPPING",
             timeout=20, every=0.5)
    assert sky.job_status("a", 1) == "SUCCEEDED" and sky.endpoint("a", 8443)  # UP or AUTOSTOPPING: answered
    assert "exit" not in " ".join(sky.logs("a"))
    hold.unlink()
    wait_for("autodown", lambda: sky.status("a", refresh=True) is None, timeout=20, every=0.5)
    assert leftover_processes(root) == {}


@pytest.mark.parametrize("head_alive, cloud, autostop", [(True, "aws", 5), (False, "aws", 5), (False, "kubernetes", -1)],
                         ids=["head-alive", "head-dead", "head-dead-k8s"])
def test_a_broken_node_is_init_unhealthy_and_loses_its_autostop_only_with_its_head_on_pods(sky, root, monkeypatch,
                                                                                          head_alive, cloud, autostop):
    """backend_utils.py:3150-3183: the refresh's cancel of the autostop goes to the head; a dead VM head fails it
    with SSH's 255 and the autostop is kept, kubectl's error on Kubernetes has it set to -1."""
    monkeypatch.setenv(ENV_CLOUDS, "aws,kubernetes")
    task = small_task("sleep 60")
    task["resources"] = {"cloud": cloud, "ports": 8443}  # a CPU machine: the catalog has no Kubernetes GPU
    sky.launch(task, secrets={}, cluster_name="b", idle_minutes=5)
    wait_for("job running", lambda: sky.job_status("b", 1) == "RUNNING", timeout=10)
    sky.break_cluster("b", head_alive=head_alive)
    time.sleep(2.0)
    info = sky.status("b", refresh=True)
    assert (info.status, info.init_kind) == ("INIT", "unhealthy")
    assert info.autostop_minutes == autostop
    assert sky.job_status("b", 1) is None  # INIT: not answered
    assert bool(leftover_processes(root)) is head_alive  # a dead head runs nothing; its disks still bill
    assert sky.down("b") is True and sky.status("b") is None


@pytest.mark.parametrize("rank", [0, 1])
def test_a_preempted_node_of_several_leaves_the_job_running_and_the_autostop_kept(sky, root, rank):
    """One node of two taken: INIT 'unhealthy', the autostop kept (a VM cloud), the other node running on, and the
    job never ends while the lost node's task waits for a bundle that cannot be placed; losing the head loses
    the skylet, so even the survivor's end brings no autodown. Only `down` ends it."""
    stop = root / "stop"
    task = small_task('while [ ! -e "$STOP" ]; do sleep 0.1; done', STOP=str(stop))
    sky.launch({**task, "num_nodes": 2}, secrets={}, cluster_name="n", idle_minutes=0)
    wait_for("job running", lambda: sky.job_status("n", 1) == "RUNNING", timeout=10)
    survivor = str(1 - rank)
    sky.preempt_node("n", rank)
    wait_for("refreshed", lambda: sky.status("n", refresh=True).status != "UP", timeout=10)  # AUTO: 2 s old
    info = sky.status("n", refresh=True)
    assert (info.status, info.init_kind, info.autostop_minutes) == ("INIT", "unhealthy", 0)
    left = leftover_processes(root)
    skylet = {pid for pid, line in left.items() if "sky_standin supervise" in line}  # the head's skylet and driver
    tasks = set(left) - skylet
    assert len(skylet) == (rank != 0) and tasks, left
    assert all(_marker_of(pid, ENV_NODE) == survivor for pid in tasks), left
    data = json.loads((root / "clusters" / "n" / "cluster.json").read_text())
    assert data["jobs"]["1"]["status"] == "RUNNING" and data["lost_nodes"] == [rank]
    stop.touch()  # the survivor's task ends well (exit 0): the job still waits on the lost one, nothing autodowns
    wait_for("the survivor's task ended", lambda: not set(leftover_processes(root)) - skylet, timeout=10)
    time.sleep(2.0)
    assert json.loads((root / "clusters" / "n" / "cluster.json").read_text())["jobs"]["1"]["status"] == "RUNNING"
    assert sky.status("n", refresh=True).status == "INIT"
    assert sky.down("n") is True and sky.status("n") is None and leftover_processes(root) == {}


@pytest.mark.parametrize("cloud", ["aws", "kubernetes"])
def test_a_node_that_shuts_itself_down_is_stopped_by_its_cloud_but_a_pod_cannot(sky, root, monkeypatch, cloud):
    """The image's sudo (passwordless, as on SkyPilot's images) hands `shutdown` to the stand-in's cloud, never to
    this machine: `-h +1` returns at once and the node goes a (stand-in) minute later, its processes ended, the
    head running on; SkyPilot's refresh then says INIT 'unhealthy', the autostop kept (the head lives). A Kubernetes
    pod has no systemd: the command fails and the pod runs on."""
    monkeypatch.setenv(ENV_CLOUDS, "aws,kubernetes")
    task = small_task('if [ "$SKYPILOT_NODE_RANK" = 1 ]; then sudo -n shutdown -h +1 && echo "scheduled"'
                      ' || echo "failed $?"; fi; sleep 600')
    task["resources"] = {"cloud": cloud, "ports": 8443}
    sky.launch({**task, "num_nodes": 2}, secrets={}, cluster_name="off", idle_minutes=5)
    log = root / "clusters" / "off" / "job.log"
    wait_for("the shutdown asked", lambda: log.exists() and ("scheduled" in log.read_text()
                                                              or "failed" in log.read_text()), timeout=30)
    if cloud == "kubernetes":
        assert "failed 1" in log.read_text() and "booted with systemd" in log.read_text()
        time.sleep(1.0)  # two stand-in minutes: nothing happens
        assert {_marker_of(pid, ENV_NODE) for pid in leftover_processes(root)} >= {"0", "1"}
    else:
        cluster = root / "clusters" / "off" / "cluster.json"
        wait_for("node 1 off", lambda: json.loads(cluster.read_text()).get("stopped_nodes") == [1], timeout=10)
        left = leftover_processes(root)
        assert left and all(_marker_of(pid, ENV_NODE) != "1" for pid in left), left  # the head runs on
        wait_for("refreshed", lambda: sky.status("off", refresh=True).status != "UP", timeout=10)  # AUTO: 2 s old
        info = sky.status("off", refresh=True)
        assert (info.status, info.init_kind, info.autostop_minutes) == ("INIT", "unhealthy", 5)
    assert sky.down("off") is True and sky.status("off") is None and leftover_processes(root) == {}


# ---------------------------------------------------------------------------------------------- the node's Python


def test_a_python_the_lock_does_not_serve_gets_a_cpython_from_uv(root, wheel, monkeypatch):
    """Ubuntu 22.04's python3 is 3.10; the gpu lock needs 3.11+ (ARTCLOUD_PYTHON). The setup leaves python3 alone
    and has uv install a CPython the lock serves (here: the stand-in's uv offers this machine's 3.11)."""
    monkeypatch.setenv("ARTCLOUD_STANDIN_PYTHON", find_python("3.10"))
    sky = LocalSky()
    made, secrets = launch_secrets()
    task = build_task(secrets=secrets, gpu="L4:1", wheel=wheel)
    assert task.config["envs"]["ARTCLOUD_PYTHON"] == ">=3.11,<3.13"
    task.config["run"] = ('"$HOME/artcloud-venv/bin/python" -c "import sys, artcloud; print(sys.version_info[:2])"; '
                          'python3 -c "import sys; print(\'image\', sys.version_info[:2])"')
    sky.launch(task.config, secrets=task.secrets, cluster_name="u22", idle_minutes=1)
    wait_for("job end", lambda: sky.job_status("u22", 1) in ("SUCCEEDED", "FAILED_SETUP", "FAILED"), timeout=120)
    lines = list(sky.logs("u22"))
    assert sky.job_status("u22", 1) == "SUCCEEDED", "\n".join(lines[-20:])
    assert lines[-2:] == ["(3, 11)", "image (3, 10)"]
    assert any("the image's python3 is Python 3.10" in line and "uv installs a CPython" in line for line in lines)


def test_a_lock_resolved_on_a_python_it_does_not_serve_fails_the_setup_as_on_a_node(root, wheel, monkeypatch):
    """What a real GCP node did: the venv made from its 3.10 python3, then `uv pip install -c gpu.txt` finds no
    solution (the lock's pins need 3.11). Forcing ARTCLOUD_PYTHON to admit 3.10 shows the stand-in resolves the lock
    for real, with the node's Python, instead of trusting what is installed."""
    monkeypatch.setenv("ARTCLOUD_STANDIN_PYTHON", find_python("3.10"))
    sky = LocalSky()
    made, secrets = launch_secrets()
    task = build_task(secrets=secrets, gpu="L4:1", wheel=wheel, env={"ARTCLOUD_PYTHON": ">=3.10"})
    sky.launch(task.config, secrets=task.secrets, cluster_name="u22", idle_minutes=1)
    wait_for("job end", lambda: sky.job_status("u22", 1) in ("SUCCEEDED", "FAILED_SETUP", "FAILED"), timeout=120)
    text = " ".join("\n".join(sky.logs("u22")).split())
    assert sky.job_status("u22", 1) == "FAILED_SETUP", text
    assert "No solution found when resolving dependencies" in text and "Python>=3.11" in text, text


def test_recording_sky_faults(root, monkeypatch):
    sky = RecordingSky()
    made, secrets = launch_secrets()
    task = build_task(secrets=secrets, gpu="H100:1", env={"ARTCLOUD_INSTALL": "0"})  # setup: nothing to do

    monkeypatch.setenv(ENV_FAULT, "launch_fails")
    with pytest.raises(ResourcesUnavailableError, match="retry-until-up"):
        sky.launch(task.config, secrets=task.secrets, cluster_name="f1", idle_minutes=1)
    assert sky.status("f1") is None

    monkeypatch.setenv(ENV_FAULT, "no_health")
    sky.launch(task.config, secrets=task.secrets, cluster_name="f2", idle_minutes=1)
    wait_for("job running", lambda: sky.job_status("f2", 1) == "RUNNING", timeout=10)
    host, port = sky.endpoint("f2", SERVER_PORT).split(":")
    assert host == "127.0.0.1" and not port_open(int(port))

    monkeypatch.setenv(ENV_FAULT, "job_fails")
    sky.launch(task.config, secrets=task.secrets, cluster_name="f3", idle_minutes=1)
    wait_for("job failed", lambda: sky.job_status("f3", 1) == "FAILED", timeout=10)
    assert list(sky.logs("f3")) == ["boom"]
    wait_for("autodown", lambda: sky.status("f3") is None, timeout=10)

    assert sky.down("f2") is True
    calls = read_calls(root)
    launches = [c for c in calls if c["call"] == "launch"]
    assert [c["kwargs"]["cluster_name"] for c in launches] == ["f1", "f2", "f3"]
    assert launches[0]["kwargs"]["secrets"] == {name: "<secret>" for name in secrets}
    assert launches[0]["kwargs"]["task"]["resources"]["accelerators"] == "H100:1"
    assert {"status", "job_status", "endpoint", "logs", "down"} <= {c["call"] for c in calls}
    recorded = (root / "calls.jsonl").read_text()
    assert made.token not in recorded and made.server_key not in recorded


@pytest.mark.slow
def test_launch_serves_the_wheel_then_down(sky, root, wheel):
    made, secrets = launch_secrets()
    task = build_task(secrets=secrets, gpu="H100:1", engine="auto", lease_s=600, max_duration_s=3600, wheel=wheel)
    launched = sky.launch(task.config, secrets=task.secrets, cluster_name="e2e", idle_minutes=10)
    assert launched.job_id == 1 and launched.price_per_hour == 2.49  # local-h100-1, on demand
    assert launched.resources == "1x Local(local-h100-1, {'H100': 1})"
    info = sky.status("e2e")
    assert info.status == "UP" and info.autostop_minutes == 10 and info.to_down
    assert info.resources == "1x Local(local-h100-1, {'H100': 1})"

    address = wait_for("endpoint", lambda: sky.endpoint("e2e", SERVER_PORT), timeout=30)
    assert sky.endpoint("e2e", 22) is None
    port = int(address.split(":")[1])
    ctx = client_ssl_context(made.ca_cert, check_hostname=False)
    with httpx.Client(base_url=f"https://{address}", verify=ctx, timeout=5) as client:
        def health():
            try:
                body = client.get("/health").json()
            except httpx.TransportError:
                return None
            return body if body.get("ready") else None

        body = wait_for("/health ready", health, timeout=120, every=0.2)
    assert body["version"] == __version__

    # The server runs the wheel's copy, installed into the cluster's venv, not this checkout.
    home = root.resolve() / "clusters" / "e2e" / "home"
    venv = home / "artcloud-venv"
    pids = cluster_pids(root, "e2e")
    server = [p for p in pids if "artcloud serve" in Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
              and "timeout" not in Path(f"/proc/{p}/comm").read_text()]
    assert len(server) == 1, pids
    argv = Path(f"/proc/{server[0]}/cmdline").read_bytes().split(b"\0")
    assert argv[0].decode() == str(venv / "bin" / "python")
    assert os.readlink(f"/proc/{server[0]}/cwd") == str(home / "sky_workdir")
    node_env = dict(item.split("=", 1) for item in Path(f"/proc/{server[0]}/environ").read_bytes().decode().split("\0") if "=" in item)
    found = subprocess.run([str(venv / "bin" / "python"), "-c", "import artcloud, sys; print(artcloud.__file__, sys.version_info[:2])"],
                           cwd=home / "sky_workdir", env=node_env, capture_output=True, text=True, check=True).stdout.strip()
    assert found.startswith(str(venv / "lib")) and "site-packages" in found, found
    # The server runs with its venv active (SDK contract 3, R1: SkyPilot's run activates ~/sky-user-env, and
    # FlashInfer's JIT runs `ninja` by name, which the venv holds).
    assert node_env["VIRTUAL_ENV"] == str(venv) and node_env["PATH"].split(os.pathsep)[0] == str(venv / "bin")
    # The image's python3 made the venv (with uv: it has no venv module), and it is the Python the image chose.
    image_env = {**node_env, "PATH": os.pathsep.join(node_env["PATH"].split(os.pathsep)[1:])}
    image_python = subprocess.run(["python3", "-c", "import sys; print(sys.version_info[:2])"], env=image_env,
                                  capture_output=True, text=True, check=True).stdout.strip()
    assert found.endswith(image_python)
    no_venv = subprocess.run(["python3", "-m", "venv", str(root / "plain-venv")], env=image_env, capture_output=True, text=True)
    assert no_venv.returncode != 0 and "ensurepip" in no_venv.stdout + no_venv.stderr
    # GNU timeout (the run command's belt) moves itself into a process group of its own: killing the
    # supervisor's group would miss it and the server. down() must find them anyway.
    assert len({os.getpgid(p) for p in pids}) >= 2

    text = "\n".join(sky.logs("e2e"))
    assert f"artcloud {__version__} serving on https://" in text and "lease: exits after 10m" in text
    assert f"with its lock (artcloud {__version__} lock for extras: gpu)" in text
    assert made.token not in text and made.server_key not in text

    assert sky.down("e2e") is True
    assert sky.status("e2e") is None and sky.endpoint("e2e", SERVER_PORT) is None
    assert leftover_processes(root) == {}
    assert not port_open(port)


@pytest.mark.slow
def test_the_lease_ends_the_job_then_autodown(sky, root, wheel):
    """No client ever comes: the server's lease (2 s) ends it, the job SUCCEEDS, and the cluster goes
    down one (0.5 s) "minute" later."""
    made, secrets = launch_secrets()
    task = build_task(secrets=secrets, gpu="L4:1", engine="auto", lease_s=2, max_duration_s=600, wheel=wheel)
    sky.launch(task.config, secrets=task.secrets, cluster_name="lease", idle_minutes=1)
    wait_for("job end", lambda: sky.job_status("lease", 1) not in ("PENDING", "SETTING_UP", "RUNNING"), timeout=120,
             every=0.2)
    lines = list(sky.logs("lease"))
    assert sky.job_status("lease", 1) == "SUCCEEDED", "\n".join(lines[-20:])
    assert any("no client request or heartbeat for 2s" in line for line in lines)
    wait_for("autodown", lambda: sky.status("lease") is None, timeout=10)
    assert leftover_processes(root) == {}

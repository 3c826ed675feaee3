"""Where a first real SkyPilot launch differs from the happy path: the price of what was really launched, the
clouds that are really enabled, endpoints that cannot carry TLS, clusters that are dead but still bill, and
credentials that would expire mid-run. The stand-in (tests/sky_standin.py) plays each of these as SkyPilot
0.14.1 does (see the notes in ../shared/facts.md); everything on this side of the seam is the real code.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from artcloud.backends.sky import SkyBackend, SkyError, SkyProvisioner
from artcloud.backends.sky_api import ClusterInfo
from artcloud.backends.state import StateDir
from tests.helpers import one_line_error, wait_for
from tests.sky_standin import LocalSky
from tests.test_sky import calls, cli, recording

SCRIPT = "import time\ntime.sleep(600)\n"


def detached(tmp_path: Path, name: str, **kwargs) -> SkyBackend:
    """A cluster of ours whose launch has returned (a detached run: no server to wait for)."""
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    backend = SkyBackend(gpu="H100:1", cluster_name=name, **kwargs)
    asyncio.run(backend.launch_job(script, lambda price: ["--steps", "1"]))
    return backend


# ----------------------------------------------------------------------------------------- price

def test_the_plan_prices_only_clouds_that_are_enabled(sky_env, monkeypatch):
    """H100:1 is cheapest on 'local' ($2.49), but only AWS is enabled: SkyPilot would launch AWS's $6.88."""
    recording(monkeypatch)
    monkeypatch.setenv("ARTCLOUD_STANDIN_CLOUDS", "aws")
    plan = SkyBackend(gpu="H100:1", max_duration="10h").plan()
    assert plan.offer.cloud == "aws" and plan.offer.instance_type == "p5.4xlarge"
    assert plan.price_per_hour == 6.88 and plan.max_cost == pytest.approx(68.8)
    assert "aws p5.4xlarge in us-east-1, $6.88/h; at most $68.80 for max_duration 10h00m" in str(plan)
    spot = SkyBackend(gpu="H100:1", use_spot=True, max_duration="1h").plan()
    assert spot.price_per_hour == 2.75 and "(spot)" in str(spot)
    assert "launch" not in calls(sky_env)


def test_no_enabled_cloud_has_the_gpu(sky_env, monkeypatch):
    recording(monkeypatch)
    monkeypatch.setenv("ARTCLOUD_STANDIN_CLOUDS", "lambda")
    with pytest.raises(SkyError, match=r"no enabled cloud offers A100-80GB \(enabled: lambda; A100-80GB is on aws, gcp\)"):
        SkyBackend(gpu="A100-80GB:1").plan()


def test_a_cheaper_cloud_that_cannot_open_the_port_is_never_quoted(sky_env, monkeypatch):
    """vSphere's H100 ($1.10, spot $0.55) is the catalog's cheapest and vSphere is enabled, but SkyPilot opens no port
    there (sky/clouds/vsphere.py:57): its optimizer would skip it, and artcloud's server could not be reached on it."""
    recording(monkeypatch)
    monkeypatch.setenv("ARTCLOUD_STANDIN_CLOUDS", "local,vsphere")
    plan = SkyBackend(gpu="H100:1").plan()
    assert (plan.offer.cloud, plan.price_per_hour) == ("local", 2.49)
    assert SkyBackend(gpu="H100:1", use_spot=True).plan().price_per_hour == 1.25


def test_a_cloud_that_cannot_open_the_port_is_refused_in_one_line_before_anything(sky_env, monkeypatch):
    recording(monkeypatch)
    monkeypatch.setenv("ARTCLOUD_STANDIN_CLOUDS", "local,vsphere")
    with pytest.raises(SkyError) as raised:
        asyncio.run(SkyBackend(gpu="H100:1", cloud="vsphere").start())
    assert (raised.value.code, raised.value.field) == ("cloud_without_ports", "cloud")
    assert str(raised.value) == (
        "artcloud needs an open port (8080) to reach its server, and SkyPilot cannot open one on vsphere: pin a cloud "
        "that can (e.g. cloud='aws', 'gcp', 'azure', 'kubernetes', 'lambda' or 'runpod') or leave cloud unset for the "
        "cheapest enabled one")
    assert not {"check_cloud", "gpu_offers", "launch"} & set(calls(sky_env)) and StateDir().all() == []
    one_line_error(cli("launch", "--gpu", "H100:1", "--cloud", "vsphere", "--dry-run"),
                   "SkyPilot cannot open one on vsphere", "cloud='aws'")


def test_a_cloud_whose_sdk_is_missing_names_the_extra_to_install(sky_env, monkeypatch):
    """artcloud[sky] brings SkyPilot alone; `sky check runpod` then says runpod's SDK is missing."""
    recording(monkeypatch)
    with pytest.raises(SkyError) as raised:
        asyncio.run(SkyBackend(gpu="H100:1", cloud="runpod").start())
    assert (raised.value.code, raised.value.field) == ("cloud_sdk_missing", "cloud")
    assert str(raised.value).startswith("runpod's SDK is not installed: pip install 'artcloud[sky-runpod]', then "
                                        "`sky check runpod` (sky check says: RunPod: Failed to import runpod")
    assert "launch" not in calls(sky_env) and StateDir().all() == []


def test_the_price_is_what_was_launched_not_the_catalogs_guess(sky_env, monkeypatch, tmp_path):
    """Local is sold out: SkyPilot fails over to AWS. The registry (what `artcloud status` and the budget
    read) must hold AWS's price, from the launch handle, not the $2.49 the catalog guessed."""
    monkeypatch.setenv("ARTCLOUD_STANDIN_CLOUDS", "local,aws")
    monkeypatch.setenv("ARTCLOUD_STANDIN_NO_CAPACITY", "local")
    backend = SkyBackend(gpu="H100:1", cluster_name="failover")
    assert backend.plan().price_per_hour == 2.49  # the guess
    backend = detached(tmp_path, "failover")
    record = StateDir().load("failover")
    assert backend.price_per_hour == record.price_per_hour == 6.88
    assert record.extra["resources"] == "1x AWS(p5.4xlarge, {'H100': 1})"
    assert LocalSky().down("failover")


# ----------------------------------------------------------------------------------------- endpoints

@pytest.mark.timeout(240)
def test_an_ingress_endpoint_fails_fast_and_tears_down(sky_env, monkeypatch):
    """Kubernetes with an ingress answers http://IP:80/skypilot/NS/CLUSTER/PORT: no TCP port for TLS. Waiting
    for /health there would burn the whole startup_timeout on a paid GPU."""
    monkeypatch.setenv("ARTCLOUD_STANDIN_NETWORK", "ingress")
    backend = SkyBackend(gpu="H100:1", cluster_name="ingress", startup_timeout="30m")
    started = time.monotonic()
    with pytest.raises(SkyError) as raised:
        asyncio.run(backend.start())
    assert raised.value.code == "endpoint_unusable"
    assert "http://127.0.0.1:80/skypilot/default/ingress-2ea4/8080" in str(raised.value)
    assert "kubernetes: ports: loadbalancer" in str(raised.value) and "torn down" in str(raised.value)
    assert time.monotonic() - started < 180
    assert LocalSky().status("ingress") is None and StateDir().load("ingress").state == "down"


# ----------------------------------------------------------------------------------------- dead clusters

def refreshed(name: str, status: str) -> ClusterInfo:
    """The cluster as SkyPilot's refresh sees it, once it does (an AUTO refresh skips a record younger than 2 s)."""
    def seen() -> ClusterInfo | None:
        info = LocalSky().status(name, refresh=True)
        return info if info is not None and info.status == status else None

    return wait_for(f"{name} {status}", seen, timeout=10, every=0.5)


def test_a_stopped_cluster_is_gone_and_torn_down(sky_env, tmp_path):
    """Stopped: the server is gone, the disks bill, and autodown never fires on a stopped node."""
    backend = detached(tmp_path, "stopped")
    LocalSky().stop("stopped")
    refreshed("stopped", "STOPPED")
    shown = cli("status")
    assert " STOPPED" in shown.stdout and "disks may bill: `artcloud down stopped`" in shown.stdout
    assert asyncio.run(backend.gone()) is True
    assert LocalSky().status("stopped") is None and StateDir().load("stopped").state == "down"


def test_an_unhealthy_cluster_whose_head_is_dead_fails_the_client_at_once_and_is_torn_down(sky_env, monkeypatch,
                                                                                          tmp_path):
    """A broken cluster whose head is down, on Kubernetes: SkyPilot's refresh cancels its autostop (kubectl's error is
    not SSH's 255: backend_utils.py:3157-3179), and nothing would take it down. (On a VM cloud the autostop is kept:
    tests/test_sky_node_loss.py, where the head's silent port tells.)"""
    from artcloud.backends.client import ServerGone

    monkeypatch.setenv("ARTCLOUD_STANDIN_CLOUDS", "kubernetes")
    backend = detached(tmp_path, "broken", cloud="kubernetes")
    LocalSky().break_cluster("broken", head_alive=False)
    assert refreshed("broken", "INIT").autostop_minutes == -1
    with pytest.raises(ServerGone) as raised:
        asyncio.run(backend._check_alive())
    assert raised.value.code == "cluster_dead" and "unhealthy" in str(raised.value)
    assert LocalSky().status("broken") is None and StateDir().load("broken").state == "down"


def test_a_dead_cluster_torn_down_by_its_liveness_check_is_launched_anew_at_the_next_start(sky_env, monkeypatch,
                                                                                          tmp_path):
    """The backend that reaped its cluster no longer holds one: its next start (a register) launches a new one
    instead of talking to the torn-down address."""
    from artcloud.backends.client import ServerGone

    recording(monkeypatch)
    monkeypatch.setenv("ARTCLOUD_STANDIN_CLOUDS", "kubernetes")
    backend = detached(tmp_path, "reborn", cloud="kubernetes")
    LocalSky().break_cluster("reborn", head_alive=False)
    refreshed("reborn", "INIT")
    with pytest.raises(ServerGone):
        asyncio.run(backend._check_alive())  # torn down as dead
    before = calls(sky_env)
    monkeypatch.setenv("ARTCLOUD_STANDIN_FAULT", "launch_fails")  # the new launch itself is not the point
    with pytest.raises(SkyError, match="could not launch reborn"):
        asyncio.run(backend.start())
    assert "launch" in calls(sky_env)[len(before):]


def test_an_unhealthy_cluster_whose_head_is_alive_is_not_reaped(sky_env, tmp_path):
    """INIT 'unhealthy' with the head alive keeps its autostop (backend_utils.py:3136-3145): a blip, not a death."""
    backend = detached(tmp_path, "blip")
    LocalSky().break_cluster("blip", head_alive=True)
    assert refreshed("blip", "INIT").autostop_minutes == 10  # the default idle_minutes, kept
    asyncio.run(backend._check_alive())  # no ServerGone: not dead, and its job is not known to have ended
    assert asyncio.run(backend.gone()) is False
    assert LocalSky().status("blip") is not None and StateDir().load("blip").state == "up"


def test_starting_on_a_stopped_cluster_of_ours_replaces_it(sky_env, monkeypatch, tmp_path):
    detached(tmp_path, "again")
    LocalSky().stop("again")
    refreshed("again", "STOPPED")
    recording(monkeypatch, "launch_fails")  # the new launch itself is not the point
    with pytest.raises(SkyError, match="could not launch again"):
        asyncio.run(SkyBackend(gpu="H100:1", cluster_name="again").start())
    order = [c for c in calls(sky_env) if c in ("down", "launch")]
    assert order[:2] == ["down", "launch"]


def test_only_a_stopped_cluster_or_one_whose_head_is_down_is_dead():
    """INIT is a launch in progress ('launching') or a node found unwell ('unhealthy'); only the latter with its
    autostop cancelled (the head down) is dead. AUTOSTOPPING is on its way down by itself."""
    dead = SkyProvisioner.dead
    assert dead(ClusterInfo("x", "INIT", autostop_minutes=-1, init_kind="launching")) is None
    assert dead(ClusterInfo("x", "INIT", autostop_minutes=10, init_kind="unhealthy")) is None
    assert dead(ClusterInfo("x", "INIT", autostop_minutes=10, init_kind="unhealthy"), head_answers=True) is None
    # The autostop SkyPilot could not cancel on a dead head (backend_utils.py:3157-3176): dead once the head is silent.
    assert "not answering" in dead(ClusterInfo("x", "INIT", autostop_minutes=10, init_kind="unhealthy"),
                                   head_answers=False)
    assert dead(ClusterInfo("x", "INIT", autostop_minutes=10, init_kind="launching"), head_answers=False) is None
    assert "head node down" in dead(ClusterInfo("x", "INIT", autostop_minutes=-1, init_kind="unhealthy"))
    assert dead(ClusterInfo("x", "UP", autostop_minutes=10)) is None
    assert dead(ClusterInfo("x", "AUTOSTOPPING", autostop_minutes=10)) is None
    assert "stopped" in dead(ClusterInfo("x", "STOPPED"))
    nodes = SkyProvisioner.nodes
    assert nodes(ClusterInfo("x", "UP", resources="2x AWS(p5.48xlarge, {'H100': 8})")) == 2
    assert nodes(ClusterInfo("x", "UP", resources="3x[Spot](gpus=H100:1, cpus=26)")) == 3  # SkyPilot 0.14.1's own
    assert nodes(ClusterInfo("x", "UP", resources="1x GCP(a2-highgpu-1g)")) == 1
    assert nodes(ClusterInfo("x", "UP")) == nodes(ClusterInfo("x", "UP", resources="AWS(m6i)")) == 1


# ----------------------------------------------------------------------------------------- credentials

@pytest.fixture
def temporary_aws(sky_env, monkeypatch):
    recording(monkeypatch)
    for key in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(key, str(sky_env.parent / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ASIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-example")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "session-token-example")
    return monkeypatch


def _expires_in(hours: float) -> str:
    return (datetime.now(timezone.utc) + timedelta(hours=hours)).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_session_credentials_that_expire_mid_run_are_refused(sky_env, temporary_aws):
    temporary_aws.setenv("AWS_CREDENTIAL_EXPIRATION", _expires_in(2))
    with pytest.raises(SkyError) as raised:
        asyncio.run(SkyBackend(s3="s3://b/p", max_duration="8h").start())
    assert raised.value.code == "s3_credentials_expire" and raised.value.field == "s3"
    assert "expire in 1h59m" in str(raised.value) or "expire in 2h00m" in str(raised.value)
    assert "ARTCLOUD_S3_ACCESS_KEY_ID" in str(raised.value) and "session-token-example" not in str(raised.value)
    assert "launch" not in calls(sky_env) and StateDir().all() == []


def test_session_credentials_of_unknown_expiry_only_for_short_runs(sky_env, temporary_aws):
    with pytest.raises(SkyError, match="temporary .* expiry is unknown, but the sandbox may run 8h00m"):
        asyncio.run(SkyBackend(s3="s3://b/p", max_duration="8h").start())
    assert "launch" not in calls(sky_env)


def test_credentials_that_outlive_the_run_and_scoped_keys_pass(sky_env, temporary_aws):
    from artcloud.backends.launch import s3_credentials

    temporary_aws.setenv("AWS_CREDENTIAL_EXPIRATION", _expires_in(12))
    creds = s3_credentials("s3://b/p", error=SkyError, valid_for_s=8 * 3600)
    assert creds["AWS_SESSION_TOKEN"] == "session-token-example"
    temporary_aws.setenv("AWS_CREDENTIAL_EXPIRATION", _expires_in(1))
    temporary_aws.setenv("ARTCLOUD_S3_ACCESS_KEY_ID", "AKIASCOPED")
    temporary_aws.setenv("ARTCLOUD_S3_SECRET_ACCESS_KEY", "scoped-secret")
    creds = s3_credentials("s3://b/p", error=SkyError, valid_for_s=8 * 3600)
    assert creds == {"AWS_ACCESS_KEY_ID": "AKIASCOPED", "AWS_SECRET_ACCESS_KEY": "scoped-secret"}

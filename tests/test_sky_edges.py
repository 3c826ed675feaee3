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

from artcloud.backends.sky import SkyBackend, SkyError
from artcloud.backends.state import StateDir
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

def test_a_stopped_cluster_is_gone_and_torn_down(sky_env, tmp_path):
    """Stopped: the server is gone, the disks bill, and autodown never fires on a stopped node."""
    backend = detached(tmp_path, "stopped")
    LocalSky().stop("stopped")
    assert LocalSky().status("stopped").status == "STOPPED"
    shown = cli("status")
    assert " STOPPED" in shown.stdout and "disks may bill: `artcloud down stopped`" in shown.stdout
    assert asyncio.run(backend.gone()) is True
    assert LocalSky().status("stopped") is None and StateDir().load("stopped").state == "down"


def test_an_unhealthy_cluster_fails_the_client_at_once_and_is_torn_down(sky_env, tmp_path):
    from artcloud.backends.remote import ServerGone

    backend = detached(tmp_path, "broken")
    LocalSky().break_cluster("broken")
    with pytest.raises(ServerGone) as raised:
        asyncio.run(backend._check_alive())
    assert raised.value.code == "cluster_dead" and "unhealthy" in str(raised.value)
    assert LocalSky().status("broken") is None and StateDir().load("broken").state == "down"


def test_starting_on_a_stopped_cluster_of_ours_replaces_it(sky_env, monkeypatch, tmp_path):
    detached(tmp_path, "again")
    LocalSky().stop("again")
    recording(monkeypatch, "launch_fails")  # the new launch itself is not the point
    with pytest.raises(SkyError, match="could not launch again"):
        asyncio.run(SkyBackend(gpu="H100:1", cluster_name="again").start())
    order = [c for c in calls(sky_env) if c in ("down", "launch")]
    assert order[:2] == ["down", "launch"]


def test_a_cluster_still_launching_is_not_taken_for_dead(sky_env, tmp_path):
    """INIT before the launch returned is provisioning, not a broken node."""
    from artcloud.backends.sky_api import ClusterInfo

    assert SkyBackend._dead(ClusterInfo("x", "INIT"), seen_up=False) is None
    assert SkyBackend._dead(ClusterInfo("x", "UP"), seen_up=True) is None
    assert "unhealthy" in SkyBackend._dead(ClusterInfo("x", "INIT"), seen_up=True)


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

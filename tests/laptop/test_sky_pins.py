"""What artcloud takes from the installed SkyPilot (0.14.1) without asking it at run time, pinned offline: a SkyPilot
upgrade that changes one of these fails here, not on a paid machine. The calls' signatures, as artcloud binds them,
are pinned in test_sky_calls.py (FakeSDK binds every call to the real function); here: the defaults artcloud relies on
by leaving an argument out, the enums it reads, and the tables it keeps of SkyPilot's clouds and extras.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from artcloud.backends.deps import _SKY_CLOUD_ALIASES, SKY_CLOUD_EXTRAS
from artcloud.backends.sky import FAILED_JOB
from artcloud.backends.sky_api import NO_AUTODOWN, NO_MULTI_NODE, NO_OPEN_PORTS, NO_PORT_REGIONS

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------- clouds and ports

def test_no_open_ports_is_every_cloud_skypilot_cannot_open_a_port_on(sky, monkeypatch):
    """NO_OPEN_PORTS holds exactly the clouds whose unsupported features, for any resources, include OPEN_PORTS (and
    NO_AUTODOWN, NO_MULTI_NODE those lacking AUTODOWN, MULTI_NODE)
    (clouds/hyperbolic.py:44, ibm.py:54, mithril.py:45, slurm.py:49, verda.py:44, vsphere.py:57), which a task with
    `ports` requires (resources.py:2379)."""
    from sky import clouds
    from sky.utils import registry

    assert clouds.CloudImplementationFeatures.OPEN_PORTS in sky.Resources(ports=8080).get_required_cloud_features()
    for kubernetes in (clouds.Kubernetes, clouds.SSH):  # no kubeconfig here; per context they change no port feature
        monkeypatch.setattr(kubernetes, "existing_allowed_contexts", classmethod(lambda cls, silent=False: []))
    closed = {name for name, cloud in registry.CLOUD_REGISTRY.items()
              if clouds.CloudImplementationFeatures.OPEN_PORTS in cloud._unsupported_features_for_resources(
                  sky.Resources(), None)}
    assert closed == NO_OPEN_PORTS
    for feature, pinned in ((clouds.CloudImplementationFeatures.AUTODOWN, NO_AUTODOWN),
                            (clouds.CloudImplementationFeatures.MULTI_NODE, NO_MULTI_NODE)):
        lacking = {name for name, cloud in registry.CLOUD_REGISTRY.items()
                   if feature in cloud._unsupported_features_for_resources(sky.Resources(), None)}
        assert lacking == pinned, feature
    assert {"aws", "gcp", "kubernetes", "lambda", "runpod"} <= set(registry.CLOUD_REGISTRY) - closed


def test_no_port_regions_are_where_skypilot_opens_no_port(sky, monkeypatch):
    """NO_PORT_REGIONS: SkyPilot's Lambda provisioner returns from open_ports in us-south-1 before asking Lambda's API
    for a firewall rule (sky/provision/lambda_cloud/instance.py:270-283), and asks for one in another region."""
    from sky.provision.lambda_cloud import instance

    asked = []

    class Client:
        def list_firewall_rules(self):
            asked.append("list")
            return []

        def create_firewall_rule(self, port_range, protocol):
            asked.append((tuple(port_range), protocol))

    monkeypatch.setattr(instance.lambda_utils, "LambdaCloudClient", Client)
    assert NO_PORT_REGIONS == {"lambda": frozenset({"us-south-1"})}
    for region in NO_PORT_REGIONS["lambda"]:
        instance.open_ports("c", ["8080"], {"region": region})
        assert asked == [], region
    instance.open_ports("c", ["8080"], {"region": "us-east-1"})
    assert asked == ["list", ((8080, 8080), "tcp")]


def _extra_requirements(extra: str) -> set[str]:
    """The packages skypilot[extra] adds, as canonical names."""
    found = set()
    for line in importlib.metadata.requires("skypilot") or []:
        req = Requirement(line)
        if req.marker is not None and req.marker.evaluate({"extra": extra}) and not req.marker.evaluate({"extra": ""}):
            found.add(req.name.lower().replace("_", "-"))
    return found


def test_each_artcloud_sky_cloud_extra_is_skypilots_extra_for_that_cloud(sky):
    """artcloud[sky-CLOUD] = artcloud[sky] + skypilot[CLOUD] at artcloud[sky]'s version, for a cloud SkyPilot has,
    that can open a port, and whose SkyPilot extra brings an SDK (more than the API server's own packages)."""
    from sky.utils import registry

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (pin,) = extras["sky"]
    assert pin == f"skypilot=={sky.__version__}"
    assert {name for name in extras if name.startswith("sky-")} == {f"sky-{cloud}" for cloud in SKY_CLOUD_EXTRAS}
    provided = set(importlib.metadata.metadata("skypilot").get_all("Provides-Extra"))
    server = _extra_requirements("server")
    for cloud in SKY_CLOUD_EXTRAS:
        assert extras[f"sky-{cloud}"] == ["artcloud[sky]", f"skypilot[{cloud}]=={sky.__version__}"]
        assert cloud in provided and cloud in registry.CLOUD_REGISTRY and cloud not in NO_OPEN_PORTS
        assert _extra_requirements(cloud) - server, f"skypilot[{cloud}] brings no SDK: artcloud[sky] is enough"
    # The clouds the comment says need no extra: their SkyPilot extra adds only the API server's packages.
    for cloud in ("lambda", "fluidstack", "paperspace"):
        assert cloud in provided and _extra_requirements(cloud) <= server
    for alias, cloud in _SKY_CLOUD_ALIASES.items():  # names SkyPilot takes for a cloud whose SDK is another's
        assert cloud in SKY_CLOUD_EXTRAS and (registry.CLOUD_REGISTRY.from_str(alias) is not None)
    assert _extra_requirements("ssh") == _extra_requirements("kubernetes")  # SSH node pools: kubernetes' SDK


# ----------------------------------------------------------------------------------------- status and jobs

def test_status_reads_the_cache_unless_asked_to_refresh(sky):
    """sky.status's default is the API server's cache (client/sdk.py:1912; utils/common.py:70-71 "Do not refresh")."""
    from sky.utils.common import StatusRefreshMode

    assert inspect.signature(sky.status).parameters["refresh"].default is StatusRefreshMode.NONE
    assert [m.name for m in StatusRefreshMode] == ["NONE", "AUTO", "FORCE"]


def test_cluster_statuses(sky):
    """utils/status_lib.py:18-44: PENDING is for display only; AUTOSTOPPING is still serving."""
    assert [s.value for s in sky.ClusterStatus] == ["INIT", "UP", "STOPPED", "AUTOSTOPPING", "PENDING"]


def test_cluster_job_statuses_and_the_ones_artcloud_takes_for_ended(sky):
    """skylet/job_lib.py:165-203. The FAILED_PRECHECKS / FAILED_NO_RESOURCE / FAILED_CONTROLLER that artcloud once
    listed are managed-job statuses (jobs/state.py), which a cluster job never has."""
    from sky.jobs.state import ManagedJobStatus
    from sky.skylet import job_lib

    assert sky.JobStatus is job_lib.JobStatus
    names = [s.value for s in job_lib.JobStatus]
    assert names == ["INIT", "PENDING", "SETTING_UP", "RUNNING", "FAILED_DRIVER", "SUCCEEDED", "FAILED",
                     "FAILED_SETUP", "CANCELLED"]
    for managed_only in ("FAILED_PRECHECKS", "FAILED_NO_RESOURCE", "FAILED_CONTROLLER"):
        assert managed_only not in names and managed_only in ManagedJobStatus.__members__
    # Every way a cluster job ends is one artcloud notices (the server exited: SUCCEEDED too), and no other.
    assert {s.value for s in job_lib.JobStatus if s.is_terminal()} == set(FAILED_JOB)


def test_status_response_tells_launching_from_unhealthy(sky):
    """StatusResponse.init_kind (schemas/api/responses.py:126-131): 'launching' or 'unhealthy' for INIT, else None."""
    from sky.schemas.api.responses import StatusResponse
    from sky.utils import status_lib

    field = StatusResponse.model_fields["init_kind"]
    assert field.default is None and not field.is_required()
    assert (status_lib.INIT_KIND_LAUNCHING, status_lib.INIT_KIND_UNHEALTHY) == ("launching", "unhealthy")


def test_an_artcloud_clusters_setup_runs_detached_inside_its_job(sky):
    """execution.py:924: setup is detached (it runs in the job, after `launch` returned) unless the cluster is a
    SkyPilot controller; an artcloud cluster never is."""
    from sky import execution
    from sky.utils import controller_utils

    assert "detach_setup = controller_utils.Controllers.from_name(cluster_name) is None" in inspect.getsource(
        execution)
    assert controller_utils.Controllers.from_name("artcloud-0f3a9c") is None


# ----------------------------------------------------------------------------------------- defaults left out

def _default(func, name):
    return inspect.signature(func).parameters[name].default


def test_the_defaults_artcloud_leaves_to_skypilot(sky):
    from sky.client import sdk
    from sky.skylet import autostop_lib
    from sky.utils.common import OptimizeTarget

    # launch: the cheapest machine (what Plan quotes), no prompt (it runs in a worker thread), a real launch.
    assert _default(sky.launch, "optimize_target") is OptimizeTarget.COST
    assert [_default(sky.launch, p) for p in ("_need_confirmation", "dryrun", "no_setup", "fast")] == [False] * 4
    # autodown waits for the job (the server) to end: a running job is not idle.
    assert _default(sky.launch, "wait_for") is None and _default(sky.autostop, "wait_for") is None
    assert autostop_lib.DEFAULT_AUTOSTOP_WAIT_FOR is autostop_lib.AutostopWaitFor.JOBS_AND_SSH
    # stream_and_get follows the request to its end and returns its result (follow=False returns None).
    assert _default(sky.stream_and_get, "follow") is True
    assert _default(sky.stream_and_get, "output_stream") is None
    # down tears down for real (no purge of a cluster SkyPilot could not reach).
    assert _default(sky.down, "purge") is False
    # tail_logs: job_id must be given (artcloud passes None: the latest job); preload_content=True unless artcloud
    # passes False, which gives the line iterator.
    assert _default(sky.tail_logs, "preload_content") is True
    assert inspect.signature(sky.tail_logs).parameters["job_id"].default is inspect.Parameter.empty
    # sky_server.py: the public `sky api stop`, and the read-only probe of a server still starting.
    assert inspect.signature(sdk.api_stop).parameters == {}
    assert _default(sdk._local_api_server_running, "kill") is False


@pytest.mark.parametrize("name", ["launch", "status", "job_status", "endpoints", "tail_logs", "autostop", "down",
                                  "stream_and_get", "get"])
def test_the_calls_artcloud_makes_are_exported_by_sky(sky, name):
    """`import sky; sky.NAME` is the SDK call (sky/__init__.py), not a module or a server-side function."""
    from sky.client import sdk

    assert getattr(sky, name) is getattr(sdk, name)

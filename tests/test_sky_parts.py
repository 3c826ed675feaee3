"""The small parts under SkyBackend: durations, the state registry, the wheel of this artcloud, offers."""

from __future__ import annotations

import datetime
import stat
import time
import zipfile

import pytest

from artcloud._version import __version__
from artcloud.backends.sky import SkyBackend, parse_gpu, pick_offer
from artcloud.backends.sky_api import GPUOffer
from artcloud.backends.state import SandboxRecord, StateDir, check_name
from artcloud.backends.wheel import build_wheel
from artcloud.durations import format_duration, parse_duration
from artcloud.errors import InvalidArgument


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("15m", 900), ("8h", 28800), ("1d", 86400), (" 2.5h ", 9000),
                                          ("1H", 3600), (600, 600), (2.5, 2.5), (datetime.timedelta(minutes=2), 120)])
def test_durations(text, seconds):
    """A number is seconds, as in Python (asyncio.sleep, httpx.Timeout): 600 is ten minutes, never ten hours."""
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["soon", "", "-5m", "0s", 0, "5 minutes", "1w", float("nan"), float("inf"),
                                 datetime.timedelta(seconds=-1)])
def test_bad_durations_say_how_to_write_one(bad):
    with pytest.raises(ValueError, match=r"write e\.g\. 90s, 15m, 8h or 1d|must be a positive") as caught:
        parse_duration(bad, what="--lease")
    assert caught.value.field == "lease"


@pytest.mark.parametrize("bare", ["15", "600", " 2.5 "])
def test_a_string_without_a_unit_is_refused_not_read_as_minutes(bare):
    """It meant minutes before 0.2: refused with the two ways to write it, rather than read as seconds silently."""
    number = bare.strip()
    with pytest.raises(ValueError, match=rf"--lease '{bare}' needs a unit: write {number}m for minutes or {number}s"):
        parse_duration(bare, what="--lease")


def test_every_backend_reads_a_number_as_seconds(tmp_path):
    """One rule in one constructor: LocalBackend(lease=5, startup_timeout=5) was a 300 s lease and a 5 s timeout."""
    from artcloud.backends.local import LocalBackend

    local = LocalBackend(tmp_path, lease=45, max_duration=3600, startup_timeout=5)
    assert (local.lease_s, local.max_duration_s, local.startup_timeout_s) == (45, 3600, 5)
    sky = SkyBackend(lease=45, max_duration=3600, startup_timeout=120, state_dir=tmp_path / "st", api=object())
    assert (sky.lease_s, sky.max_duration_s, sky.startup_timeout_s) == (45, 3600, 120)


def test_format_duration():
    assert [format_duration(s) for s in (5, 90, 3600 + 300, 86400 * 2 + 3600 * 4)] == ["5s", "1m", "1h05m", "2d04h"]


def test_state_registry_keeps_secrets_private_and_survives_down(tmp_path):
    state = StateDir(tmp_path / "st")
    record = SandboxRecord(name="box-1", provider="sky", gpu="H100:1", price_per_hour=3.0,
                           launched_at=time.time() - 1800)
    state.save(record, ca_cert="-----BEGIN CERTIFICATE-----\n", token="tok-" + "x" * 30)
    folder = tmp_path / "st" / "sandboxes" / "box-1"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / "token").stat().st_mode) == 0o600
    assert "tok-" not in (folder / "sandbox.json").read_text()
    assert state.credentials("box-1") == ("-----BEGIN CERTIFICATE-----\n", "tok-" + "x" * 30)
    loaded = state.load("box-1")
    assert loaded.gpu == "H100:1" and loaded.cost_so_far() == pytest.approx(1.5, abs=0.01)
    assert [r.name for r in state.live()] == ["box-1"]

    state.mark_down("box-1")
    assert state.credentials("box-1") is None and not (folder / "token").exists()
    gone = state.load("box-1")
    assert gone.state == "down" and state.live() == []
    cost = gone.cost_so_far()
    time.sleep(0.05)
    assert state.load("box-1").cost_so_far() == cost  # a sandbox that is down costs no more
    state.prune(older_than_s=0.0)
    assert state.load("box-1") is None and state.all() == []


def test_state_registry_refuses_odd_names(tmp_path):
    with pytest.raises(ValueError, match="must start with a letter"):
        StateDir(tmp_path).save(SandboxRecord(name="../etc", provider="sky"))


# Names SkyPilot and Modal take (a-z first, a-z 0-9 last, '-' between, 63 at most); then names one of them refuses
# ("box-": SkyPilot, after the wheel was built) or that are no DNS label.
GOOD_NAMES = ["a", "box-1", "mail-agent", "a" * 63, "a--b", "run-20260101-120000", "artcloud-0f3a9c"]
BAD_NAMES = ["box-", "a-", "-box", "1box", "123", "Box", "box_1", "box.1", "", "a" * 64, "a b", "../etc", "box1\n"]


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_check_name_takes_names_every_provider_takes(name):
    assert check_name(name) == name


@pytest.mark.parametrize("name", BAD_NAMES)
def test_check_name_refuses_what_a_provider_refuses_before_anything_is_built(name):
    with pytest.raises(ValueError, match="must start with a letter, end with a letter or digit"):
        check_name(name)
    if name:  # no name: a fresh artcloud-XXXXXX
        with pytest.raises(ValueError, match="sandbox name"):  # at construction: before a wheel or a launch
            SkyBackend(gpu="L4", cluster_name=name, api=object())


@pytest.mark.parametrize("name", GOOD_NAMES + BAD_NAMES)
def test_modal_takes_every_name_check_name_takes(name):
    name_utils = pytest.importorskip("modal._utils.name_utils")
    try:
        check_name(name)
    except ValueError:
        return
    assert name_utils.is_valid_object_name(name)  # what modal.Sandbox.create(name=...) checks


def test_wheel_of_this_artcloud(tmp_path):
    wheel = build_wheel(tmp_path)
    assert wheel.name == f"artcloud-{__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(f"artcloud-{__version__}.dist-info/METADATA").decode()
        record = z.read(f"artcloud-{__version__}.dist-info/RECORD").decode()
    assert "artcloud/server/main.py" in names and "artcloud/templates/artcloud-server.yaml" in names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    assert f"Version: {__version__}" in meta and "Provides-Extra: gpu" in meta
    assert "artcloud/server/main.py,sha256=" in record
    again = build_wheel(tmp_path / "again")
    assert again.read_bytes() == wheel.read_bytes()  # reproducible: an image built from it is cached


def offers():
    return [GPUOffer("aws", "p5.48xlarge", "H100", 8, 98.3, 30.0), GPUOffer("aws", "p5.4xlarge", "H100", 1, 6.9, 2.1),
            GPUOffer("lambda", "gpu_1x_h100", "H100", 1, 2.49, None)]


def test_pick_offer_takes_the_cheapest_that_fits():
    assert pick_offer(offers(), "H100:1", cloud=None, use_spot=False).price == 2.49
    assert pick_offer(offers(), "H100:1", cloud=None, use_spot=True).spot_price == 2.1
    assert pick_offer(offers(), "H100:8", cloud="AWS", use_spot=False).instance_type == "p5.48xlarge"
    with pytest.raises(ValueError, match="gcp offers no H100"):
        pick_offer(offers(), "H100:1", cloud="gcp", use_spot=False)
    with pytest.raises(ValueError, match=r"no machine has 2x H100: choose a count among \[1, 8\]"):
        pick_offer(offers(), "H100:2", cloud=None, use_spot=False)
    with pytest.raises(ValueError, match="no GPU named 'H1000'"):
        pick_offer([], "H1000", cloud=None, use_spot=False)
    assert parse_gpu("L4") == ("L4", 1) and parse_gpu("A100-80GB:2") == ("A100-80GB", 2)


def test_pick_offer_never_quotes_a_cloud_that_cannot_open_artclouds_port():
    """vSphere is cheapest here, but SkyPilot cannot open a port there (sky/clouds/vsphere.py:57): the optimizer
    would drop it, and artcloud's server could not be reached on it."""
    cheap = [*offers(), GPUOffer("vSphere", "vsphere-h100", "H100", 1, 0.5, 0.2)]
    assert pick_offer(cheap, "H100:1", cloud=None, use_spot=False).cloud == "lambda"
    assert pick_offer(cheap, "H100:1", cloud=None, use_spot=True).spot_price == 2.1
    assert pick_offer(cheap, "H100:1", cloud=None, use_spot=False, enabled=["vsphere", "aws"]).cloud == "aws"
    for pinned in ("vsphere", "IBM", "slurm"):
        with pytest.raises(ValueError, match=rf"artcloud needs an open port \(8080\) to reach its server, and SkyPilot "
                                             rf"cannot open one on {pinned}: pin a cloud that can \(e\.g\. cloud='aws'"
                           ) as raised:
            pick_offer(cheap, "H100:1", cloud=pinned, use_spot=False)
        assert raised.value.field == "cloud" and raised.value.code == "cloud_without_ports"
    only_closed = [GPUOffer("Hyperbolic", "h", "H200", 1, 2.0, None), GPUOffer("Verda", "v", "H200", 1, 2.1, None)]
    with pytest.raises(ValueError, match=r"H200 is only on Hyperbolic, Verda, where SkyPilot cannot give artcloud's "
                                         r"server what it needs \(an open port and autodown\)"):
        pick_offer(only_closed, "H200:1", cloud=None, use_spot=False)


def test_pick_offer_never_quotes_a_cloud_without_autodown_nor_one_node_for_several():
    """SDK contract 3, N2: every artcloud launch asks SkyPilot for autodown, which PrimeIntellect cannot do
    (sky/clouds/primeintellect.py:30), and num_nodes > 1 needs MULTI_NODE, which RunPod lacks (runpod.py:30): the
    optimizer or the provisioner would refuse the launch that the plan and max_cost had quoted."""
    cheap = [*offers(), GPUOffer("PrimeIntellect", "pi-h100", "H100", 1, 1.0, None),
             GPUOffer("RunPod", "1x_H100", "H100", 1, 2.0, None)]
    assert pick_offer(cheap, "H100:1", cloud=None, use_spot=False).cloud == "RunPod"
    assert pick_offer(cheap, "H100:1", cloud=None, use_spot=False, num_nodes=2).cloud == "lambda"
    with pytest.raises(ValueError, match=r"autodown\), and SkyPilot cannot on primeintellect: pin a cloud") as raised:
        pick_offer(cheap, "H100:1", cloud="primeintellect", use_spot=False)
    assert (raised.value.code, raised.value.field) == ("cloud_without_autodown", "cloud")
    with pytest.raises(ValueError, match=r"SkyPilot runs one node at most on runpod, and num_nodes is 2: pin a cloud "
                                         r"that runs several \(e\.g\. cloud='aws', 'gcp', 'azure' or 'lambda'\), or use "
                                         r"num_nodes=1") as raised:
        pick_offer(cheap, "H100:1", cloud="runpod", use_spot=False, num_nodes=2)
    assert raised.value.code == "cloud_single_node"
    assert pick_offer(cheap, "H100:1", cloud="runpod", use_spot=False).cloud == "RunPod"  # one node: fine
    # Kubernetes (and SSH node pools, which are Kubernetes) runs several pods, but its Service for port 8080 selects
    # them all (sky/provision/kubernetes/network.py:55-62): SDK contract 3, N1.
    pods = [*cheap, GPUOffer("Kubernetes", "2CPU--8GB--1H100", "H100", 1, 0.5, None)]
    assert pick_offer(pods, "H100:1", cloud=None, use_spot=False).cloud == "Kubernetes"
    assert pick_offer(pods, "H100:1", cloud=None, use_spot=False, num_nodes=2).cloud == "lambda"
    for pinned in ("kubernetes", "ssh"):
        with pytest.raises(ValueError, match=rf"SkyPilot's {pinned} sends port 8080 to every pod of a cluster, and "
                                             r"artcloud's server runs on the first: use num_nodes=1 there") as raised:
            pick_offer(pods, "H100:1", cloud=pinned, use_spot=False, num_nodes=2)
        assert raised.value.code == "cloud_single_node"


def test_lambdas_us_south_1_where_skypilot_opens_no_port_is_never_quoted_nor_launched_in():
    """SDK contract 3, N6: SkyPilot skips opening ports in Lambda's us-south-1 with a warning only
    (sky/provision/lambda_cloud/instance.py:270-283; pinned in tests/laptop/test_sky_pins.py), so a server there is
    never reached."""
    south = GPUOffer("lambda", "gpu_1x_h100", "H100", 1, 1.99, None, "us-south-1")
    east = GPUOffer("lambda", "gpu_1x_h100", "H100", 1, 2.49, None, "us-east-1")
    assert pick_offer([south, east], "H100:1", cloud=None, use_spot=False).region == "us-east-1"
    assert pick_offer([south, east], "H100:1", cloud="lambda", use_spot=False).region == "us-east-1"
    with pytest.raises(InvalidArgument, match=r"SkyPilot opens no port in lambda's us-south-1 \(no firewall rules "
                                              r"there\), and artcloud reaches its server on one: pin another region "
                                              r"of it") as raised:
        SkyBackend(gpu="H100:1", cloud="lambda", region="us-south-1", api=object())
    assert raised.value.field == "region"
    assert SkyBackend(gpu="H100:1", cloud="Lambda", region="us-east-1", api=object()).region == "us-east-1"


def test_no_enabled_cloud_names_the_extra_that_brings_a_clouds_sdk():
    with pytest.raises(ValueError, match=r"no enabled cloud offers H100 \(enabled: none; H100 is on aws, lambda\): set "
                                         r"one of those up \(e\.g\. pip install 'artcloud\[sky-aws\]', and its "
                                         r"credentials\), then `sky check`"):
        pick_offer(offers(), "H100:1", cloud=None, use_spot=False, enabled=[])
    with pytest.raises(ValueError, match=r"H100 is on lambda\): set one of those up, then `sky check`"):
        pick_offer(offers()[2:], "H100:1", cloud=None, use_spot=False, enabled=[])  # Lambda needs no SDK


@pytest.mark.parametrize("cloud,reason,install", [
    ("aws", "AWS: disabled Reason [compute, storage]: AWS dependencies are not installed. Run the following commands: "
            "$ pip install skypilot[aws]", "pip install 'artcloud[sky-aws]'"),
    ("RunPod", 'RunPod: disabled Reason [compute]: Failed to import runpod or TOML parser. Install: pip install '
               '"skypilot[runpod]".', "pip install 'artcloud[sky-runpod]'"),
    ("ssh", 'Failed to import dependencies for Kubernetes. Try running: pip install "skypilot[kubernetes]"',
     "pip install 'artcloud[sky-kubernetes]'"),
    ("aws", "AWS: disabled Reason [compute, storage]: AWS credentials are not set. Run the following commands: "
            "$ aws configure", None),  # installed, not set up: no pip install helps
    ("kubernetes", "Kubernetes: disabled Reason [compute]: `socat` is required ... $ sudo apt install socat netcat",
     None),  # a system tool
    ("lambda", "Failed to access Lambda Cloud with credentials.", None),  # no SDK to install
])
def test_a_missing_cloud_sdk_is_named_as_the_artcloud_extra(cloud, reason, install):
    from artcloud.backends.deps import sky_cloud_install

    assert sky_cloud_install(cloud, reason) == install


def test_the_preemption_hook_goes_only_where_skypilot_can_run_it():
    """The hook runs on Kubernetes only; declared, it costs every `sky down` a command on the head first."""
    from artcloud.backends.sky_task import build_task

    secrets = {"ARTCLOUD_TOKEN": "t", "ARTCLOUD_TLS_CERT": "c", "ARTCLOUD_TLS_KEY": "k"}
    hooks = lambda **kw: build_task(secrets=secrets, **kw).config.get("config", {}).get("hooks")  # noqa: E731
    assert hooks()[0]["events"] == ["preemption"]  # unpinned: the optimizer may pick Kubernetes
    assert hooks(cloud="kubernetes")[0]["events"] == ["preemption"]
    assert hooks(cloud="aws") is None and hooks(cloud="gcp", region="us-central1") is None


def test_every_backend_heartbeats_three_times_per_lease(tmp_path):
    """A 30 s lease under a live client must not end: LocalBackend beat every 60 s whatever its lease."""
    from artcloud.backends.local import LocalBackend

    assert LocalBackend(tmp_path, lease="30s").heartbeat_every_s == 10
    assert LocalBackend(tmp_path).heartbeat_every_s == 60  # no lease: the server never ends for want of one
    assert SkyBackend(lease="30s", state_dir=tmp_path / "st", api=object()).heartbeat_every_s == 10


def test_one_spec_the_same_names_on_every_backend_and_the_old_ones_warn(tmp_path):
    """SandboxSpec checks once what every backend shares; 0.1's spellings still work, each with a DeprecationWarning
    that names the new one."""
    import warnings

    import artcloud
    from artcloud.backends.modal import ModalBackend

    spec = artcloud.SandboxSpec(gpu="L4", spot=True, disk=100, s3="s3://b/p", lease=60, max_duration="2h", name="box-1")
    assert (spec.lease, spec.max_duration, spec.startup_timeout) == (60, 7200, 1800)
    sky = SkyBackend(**{k: getattr(spec, k) for k in ("gpu", "spot", "disk", "s3", "lease", "max_duration", "name")},
                     state_dir=tmp_path / "st", api=object())
    assert (sky.cluster_name, sky.use_spot, sky.disk_size, sky.spec) == ("box-1", True, 100, spec)
    modal = ModalBackend(gpu="H100", name="box-2", max_duration="2h", state_dir=tmp_path / "st")
    assert modal.timeout_s == 7200 and modal.spec.name == "box-2"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = SkyBackend(cluster_name="box-3", use_spot=True, disk_size=50, state_dir=tmp_path / "st", api=object())
        old_modal = ModalBackend(timeout="3h", state_dir=tmp_path / "st")
    assert (old.cluster_name, old.use_spot, old.disk_size, old_modal.timeout_s) == ("box-3", True, 50, 10800)
    said = sorted(str(w.message).split(" is now")[0] for w in caught if w.category is DeprecationWarning)
    assert said == ["ModalBackend(timeout=...)", "SkyBackend(cluster_name=...)", "SkyBackend(disk_size=...)",
                    "SkyBackend(use_spot=...)"]
    for bad, field in (({"engine": "gpu"}, "engine"), ({"disk": 5}, "disk"), ({"s3": "bucket"}, "s3"),
                       ({"lease": "30"}, "lease"), ({"name": "Bad_Name"}, None)):
        with pytest.raises(ValueError) as caught_error:
            artcloud.SandboxSpec(**bad)
        assert caught_error.value.field == field, bad
    with pytest.raises(ValueError, match="region= needs cloud= too") as caught_error:
        SkyBackend(region="us-east-1", state_dir=tmp_path / "st", api=object())
    assert caught_error.value.field == "region"
    assert ModalBackend(region="us-east", state_dir=tmp_path / "st").region == "us-east"  # Modal's need no cloud
    with pytest.raises(ValueError, match="cloud= is SkyBackend's"):
        ModalBackend(cloud="aws", state_dir=tmp_path / "st")
    with pytest.raises(TypeError, match="unexpected keyword argument 'clusterr_name'"):
        SkyBackend(clusterr_name="x", state_dir=tmp_path / "st", api=object())
